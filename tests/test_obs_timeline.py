import json
import threading

import pytest

from oppo_engine.obs.timeline import Timeline


def test_busy_fraction_counts_overlapping_spans_once():
    tl = Timeline()
    tl.record("actor", "decode", 0.0, 4.0)
    tl.record("actor", "decode", 2.0, 6.0)  # overlaps the first by 2 s
    tl.record("actor", "decode", 6.0, 7.0)  # touches the second
    tl.record("reward", "prefill", 1.0, 2.0)
    busy = tl.busy_fraction(0.0, 10.0)
    assert busy["actor"] == pytest.approx(0.7)
    assert busy["reward"] == pytest.approx(0.1)


def test_busy_fraction_clips_spans_to_the_window_and_reports_idle_lanes():
    tl = Timeline()
    tl.record("actor", "decode", -5.0, 3.0)  # starts before the window
    tl.record("actor", "decode", 8.0, 20.0)  # ends after it
    tl.record("reward", "prefill", 11.0, 12.0)  # entirely outside
    busy = tl.busy_fraction(0.0, 10.0)
    assert busy["actor"] == pytest.approx(0.5)
    assert busy["reward"] == 0.0


def test_busy_fraction_of_nested_spans_never_exceeds_one():
    tl = Timeline()
    for i in range(5):
        tl.record("scorer", "prefill", float(i), 10.0 - i)
    assert tl.busy_fraction(0.0, 10.0)["scorer"] == pytest.approx(1.0)


def test_bad_window_and_reversed_span_are_rejected():
    tl = Timeline()
    with pytest.raises(ValueError, match="end_s"):
        tl.record("actor", "decode", 2.0, 1.0)
    with pytest.raises(ValueError, match="window"):
        tl.busy_fraction(1.0, 1.0)


def test_span_context_manager_records_even_when_body_raises():
    tl = Timeline()
    with pytest.raises(RuntimeError):
        with tl.span("actor", "decode", chunk=4):
            raise RuntimeError("boom")
    (s,) = tl.spans()
    assert (s.lane, s.name, s.args) == ("actor", "decode", {"chunk": 4})
    assert s.end_s >= s.start_s
    tl.clear()
    assert tl.spans() == []


def test_chrome_trace_has_one_complete_event_per_span_and_named_lane_threads(tmp_path):
    tl = Timeline()
    tl.record("actor", "decode", 10.0, 10.5, tokens=8)
    tl.record("reward", "prefill", 10.25, 11.0)
    tl.record("actor", "decode", 10.5, 10.75)
    path = tl.to_chrome_trace(tmp_path / "sub" / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["actor", "reward"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == 3
    first = xs[0]
    assert names[first["tid"]] == "actor" and first["name"] == "decode" and first["args"] == {"tokens": 8}
    assert first["ts"] == pytest.approx(0.0) and first["dur"] == pytest.approx(500_000.0)
    reward = next(e for e in xs if names[e["tid"]] == "reward")
    assert reward["ts"] == pytest.approx(250_000.0) and reward["dur"] == pytest.approx(750_000.0)


def test_concurrent_recording_from_threads_loses_nothing():
    tl = Timeline()
    n_threads, per_thread = 8, 500
    barrier = threading.Barrier(n_threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            if i % 2:
                tl.record(f"lane{t}", "r", float(i), float(i) + 0.5, i=i)
            else:
                with tl.span(f"lane{t}", "s", i=i):
                    pass

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    spans = tl.spans()
    assert len(spans) == n_threads * per_thread
    for t in range(n_threads):
        assert sorted(s.args["i"] for s in spans if s.lane == f"lane{t}") == list(range(per_thread))
