"""``oppo-engine serve``: the OpenAI-compatible endpoint of an engine over a pretrained actor, as a process.

It loads the actor (a bundled name, a local Hugging Face folder or a ``.gguf`` file: ``load_pretrained``),
serves it (``RolloutEngine.serve``) and steps the engine until it is stopped (SIGINT or SIGTERM), so that
requests -- plain ``/v1`` ones (evaluation) and episodes' -- are decoded. Nothing is trained: the episodes'
rollouts are counted, and written as JSON lines with ``--rollouts FILE``.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time

_IDLE_S = 0.01  # a step with nothing to do returns at once: wait this long before the next


def serve_main(argv: list[str]) -> int:
    """Serve ``--actor`` on ``--host``:``--port`` until SIGINT or SIGTERM (see the module)."""
    import torch

    from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
    from oppo_engine.pretrained import load_pretrained

    p = argparse.ArgumentParser(prog="oppo-engine serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--actor", required=True, help="a bundled model name, a local HF folder or a .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (beyond loopback: give --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: a free one)")
    p.add_argument("--api-key", default=None, help="the key every request must carry (Bearer)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--batch-size", type=int, default=8, help="episodes per step (B)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="an episode's sampled tokens, all turns")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (None: the model's)")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (an episode's without its own)")
    p.add_argument("--rollouts", default=None, help="append each episode's rollout to this file (JSON lines)")
    args = p.parse_args(argv)
    engine = None
    try:
        actor, tokenizer = load_pretrained(args.actor)
        engine = RolloutEngine(
            actor.to(args.device), reward=lambda prompt, response: 0.0, tokenizer=tokenizer,
            config=EngineConfig(batch_size=args.batch_size, max_model_len=args.max_model_len),
            sampling=SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed),
        )  # fmt: skip
        handle = engine.serve(host=args.host, port=args.port, api_key=args.api_key)
    except (ValueError, FileNotFoundError) as e:
        p.exit(2, f"oppo-engine serve: {e}\n")
    except OSError as e:  # the port is in use, or the address cannot be bound
        if engine is not None:
            engine.close()
        p.exit(2, f"oppo-engine serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}\n")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def close_when_stopped() -> None:  # the endpoint first: a step waiting for first requests returns
        stop.wait()
        handle.close()

    closer = threading.Thread(target=close_when_stopped, name="oppo-serve-stop", daemon=True)
    closer.start()
    print(f"oppo-engine serve: {args.actor} at {handle.url}/v1", flush=True)
    out = open(args.rollouts, "a") if args.rollouts else None  # noqa: SIM115 (closed below)
    returned = failed = 0
    try:
        while not stop.is_set():
            result = engine.step()
            returned, failed = returned + len(result.rollouts), failed + len(result.failed)
            for r in result.rollouts if out is not None else ():
                fields = ("prompt_ids", "response_ids", "action_mask", "logprobs", "reward", "finish_reason")
                out.write(json.dumps({name: getattr(r, name) for name in fields}) + "\n")
            if out is not None:
                out.flush()
            if not (result.rollouts or result.failed):
                time.sleep(_IDLE_S)
    finally:
        stop.set()  # the endpoint is closed by one thread, before the engine: never two closes at once
        closer.join()
        engine.close()
        if out is not None:
            out.close()
    print(f"oppo-engine serve: stopped; {returned} episodes returned, {failed} failed", flush=True)
    return 0
