"""`attnserve generate` on the tiny model (fp32, which reverses its input's pieces): one output
line per input line, in order, each the greedy output of its sentences decoded alone; lines
without tokens written as they are; sampled files repeatable by seed whatever the replicas and
however the file is cut into parts; bad options a one-line error and status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve.cli import main
from service.generation.search import generate
from service.process import commands
from service.runtime import ModelRuntime

LINES = ["abc de", "", "kol. ab", "edcba", "a b c", "   ", "hij"]


def run(tmp_path: Path, repository: Path, *options: str, lines: list[str] = LINES, name: str = "out") -> list[str]:
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    target = tmp_path / f"{name}.txt"
    status = main(["generate", "--model", str(repository), "--input", str(source), "--output", str(target),
                   "--variant", "fp32", *options])
    assert status == 0
    return target.read_text(encoding="utf-8").split("\n")[:-1]


def test_each_line_is_its_sentences_greedy_outputs_in_order(tmp_path: Path, tiny_model_repository: Path) -> None:
    found = run(tmp_path, tiny_model_repository, "--replicas", "2", "--rows", "4")
    runtime = ModelRuntime.load(tiny_model_repository, ["CPUExecutionProvider"], threads=1, variant="fp32")

    def alone(text: str) -> str:
        source = [*runtime.tokenizer.encode(text), runtime.eos_id]
        return runtime.tokenizer.decode(generate(runtime, [source], 1, runtime.max_target_len)[0].tokens)

    assert len(found) == len(LINES)
    assert found[0] == alone("abc de") and found[0].strip() == "ed cba"
    assert found[1] == "" and found[5] == "   "  # no tokens: as they are
    assert found[2] == f"{alone('kol.')} {alone('ab')}"  # two sentences, each its own row
    assert [found[i] for i in (3, 4, 6)] == [alone(LINES[i]) for i in (3, 4, 6)]


def test_sampled_outputs_repeat_by_seed_whatever_the_replicas_and_parts(
        tmp_path: Path, tiny_model_repository: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [line for line in LINES if line.strip()] * 4
    sampled = ("--temperature", "4", "--seed", "3")
    one = run(tmp_path, tiny_model_repository, *sampled, "--replicas", "1", lines=lines, name="one")
    two = run(tmp_path, tiny_model_repository, *sampled, "--replicas", "2", "--rows", "3", lines=lines, name="two")
    monkeypatch.setattr(commands, "LINES_PER_PART", 5)  # the file read five lines at a time
    parts = run(tmp_path, tiny_model_repository, *sampled, "--replicas", "2", lines=lines, name="parts")
    other = run(tmp_path, tiny_model_repository, "--temperature", "4", "--seed", "4", lines=lines, name="other")
    greedy = run(tmp_path, tiny_model_repository, lines=lines, name="greedy")
    assert one == two == parts
    assert one != other and one != greedy
    assert len(set(one[0::6])) > 1  # the same line, other rows: other draws


@pytest.mark.parametrize(("options", "message"), [
    (("--top-p", "0.9"), "--top-p: applies to sampling only"),
    (("--temperature", "1", "--beam-size", "2"), "beam-size"),
    (("--rows", "0"), "--rows"),
])
def test_bad_options_are_one_line_and_status_2(tmp_path: Path, tiny_model_repository: Path, options: tuple[str, ...],
                                               message: str, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "in.txt"
    source.write_text("abc\n", encoding="utf-8")
    status = main(["generate", "--model", str(tiny_model_repository), "--input", str(source), *options])
    assert status == 2 and message in caplog.text
