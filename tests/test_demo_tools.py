"""``oppo-engine demo --task tools`` end to end, on a briefly trained actor: the same table for the four
modes, with the tool rows, and episodes that call the calculator through ``ToolEnv``."""

from __future__ import annotations

from oppo_engine.ppo import tools_task
from oppo_engine.ppo.demo import DemoOptions, run_demo


def test_the_tools_demo_prints_the_table_for_the_four_modes(tmp_path):
    cache = tools_task.build_tools_task(tmp_path / "task", steps=40, log=lambda _: None)
    lines = []
    runs = run_demo(
        DemoOptions(
            task="tools", steps=2, batch_size=4, cache=cache, out=tmp_path / "out", max_new_tokens=96
        ),
        log=lines.append,
    )
    assert [r.mode for r in runs] == ["sequential", "intra", "inter", "oppo"] and all(r.records for r in runs)
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "exposed tool s/step" in table and "tool calls/step" in table
    assert any("final answers right" in line for line in lines)


def test_the_answer_reward_reads_the_last_answer_against_the_prompts_sum():
    tokenizer = tools_task.train_tokenizer([tools_task.CHAT_TEMPLATE, "what is 12 + 7 ? the answer is 19 ."])
    reward = tools_task.AnswerReward(tokenizer)
    prompt = tokenizer.apply_chat_template(
        tools_task.prompt_messages([12, 7]), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert reward(prompt, tokenizer("the answer is 18 . the answer is 19 .")["input_ids"]) == 1.0
    assert reward(prompt, tokenizer("the answer is 19 . the answer is 18 .")["input_ids"]) == 0.0
    assert reward(prompt, tokenizer("no answer")["input_ids"]) == 0.0


def test_a_perfect_episode_renders_as_the_template_and_tool_env_produce_it():
    """The task's template is append-only: prompt + each turn + each tool answer as ToolEnv appends it equal
    the rendered perfect conversation (what the actor is warmed up on)."""
    rendered = [tools_task.CHAT_TEMPLATE] + [
        str(tools_task.conversation([a, b, c])) for a, b, c in [(1, 2, 3), (10, 20, 30), (4, 5, 6)]
    ]
    tokenizer = tools_task.train_tokenizer(rendered)
    env = tools_task.CalculatorEnv(tokenizer)
    messages = tools_task.conversation([3, 4, 5])
    transcript = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)  # fmt: skip
    env.reset(transcript)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        assert full[: len(transcript)] == transcript
        rest = full[len(transcript) :]
        turn = rest[: rest.index(env.turn_end_token_id) + 1]
        obs = env.step(turn)
        transcript += turn + obs.tokens
    assert obs.done
    assert (
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[: len(transcript)]
        == transcript
    )
