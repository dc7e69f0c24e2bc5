"""bench.join_cost on the tiny model: every mode replays the same schedule, filling dead slots
in place copies the batch less often, and the step graph's batch copies least."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.join_cost import CTRANSLATE2, MODES, STEP_MODE, main, replay


def test_join_cost_compares_the_two_join_modes(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "join_cost.json"
    assert main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
                 "--sentences", "60", "--rows", "12", "--group", "2", "--repeats", "1"]) == 0
    modes = json.loads(out.read_text(encoding="utf-8"))["modes"]
    in_place = modes["merged decoder, dead slots filled in place"]["median"]
    copying = modes["merged decoder, every join copies the batch"]["median"]
    assert in_place["steps"] > 0 and copying["steps"] > 0
    assert in_place["steps"] == copying["steps"]  # the same schedule: the same tokens
    assert 0 < in_place["copies"] < copying["copies"]  # some joins still copy (a longer source, trimming)
    scored = modes["merged decoder, dead slots filled in place, greedy scores (a log-softmax per step)"]["median"]
    assert (scored["steps"], scored["copies"]) == (in_place["steps"], in_place["copies"])  # the same tokens
    slots = modes["step graph, each row in its own slot"]["median"]
    assert slots["steps"] == in_place["steps"]  # the same tokens (fp32) on the step graph
    assert slots["copies"] < in_place["copies"]  # grown or shrunk a few times, never per join
    assert 0 < slots["leaves"] < slots["steps"] and 0 < slots["leave_s"] < slots["step_s"]  # within the steps
    assert 0 < slots["step_runtime_s"] < slots["step_s"]  # the step graph's calls, within the steps
    assert in_place["step_runtime_s"] == 0  # the merged decoder's calls are not the step graph's
    assert in_place["leaves"] == 0  # the merged decoder's dead slots stay until a newcomer fills them


def test_join_cost_times_chosen_modes_beside_ctranslate2_and_profiles_the_step_graph(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    models, data = tiny_bench_dirs
    out = tmp_path / "join_cost.json"
    slots = "step graph, each row in its own slot"
    assert main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
                 "--sentences", "20", "--rows", "8", "--repeats", "2", "--modes", slots,
                 "--ctranslate2", "--profile"]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    modes = results["modes"]
    assert set(modes) == {CTRANSLATE2, slots}
    assert len(modes[CTRANSLATE2]["runs"]) == 2 and modes[CTRANSLATE2]["median"]["total_s"] > 0
    ours = modes[slots]["median"]
    assert ours["total_s"] >= ours["join_s"] + ours["step_s"] > 0
    step_graph = results["profile"]["step_graph"]
    assert step_graph["step_ms"] > 0 and "GroupQueryAttention" in step_graph["ops"]
    assert sum(op["share"] for op in step_graph["ops"].values()) == pytest.approx(1.0, abs=0.01)
    # every kernel of a CPU run on the CPU provider, none of them a host <-> device copy
    assert set(step_graph["nodes_per_step"]) == {"CPUExecutionProvider"} and step_graph["memcpy_per_step"] == 0
    assert step_graph["nodes_per_step"]["CPUExecutionProvider"] >= len(step_graph["ops"])  # each type once a step at least
    assert results["profile"]["encoder"]["step_ms"] > 0


def test_join_cost_replays_another_export_of_the_model_in_the_same_turns(tiny_bench_dirs: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    import shutil

    models, data = tiny_bench_dirs
    other = tmp_path / "earlier" / "tiny-reverse"
    shutil.copytree(models / "tiny-reverse", other)
    out = tmp_path / "join_cost.json"
    assert main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
                 "--sentences", "20", "--rows", "8", "--repeats", "2", "--modes", STEP_MODE,
                 "--against", str(other)]) == 0
    modes = json.loads(out.read_text(encoding="utf-8"))["modes"]
    assert set(modes) == {STEP_MODE, f"{STEP_MODE} ({other})"}
    ours, theirs = modes[STEP_MODE], modes[f"{STEP_MODE} ({other})"]
    assert len(theirs["runs"]) == 2
    assert theirs["median"]["steps"] == ours["median"]["steps"] > 0  # the same graph: the same tokens
    with pytest.raises(SystemExit):  # not a repository of the model
        main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
              "--sentences", "4", "--against", str(tmp_path)])


def test_join_cost_keeps_the_slots_on_the_device_when_asked(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device-slots`: the step graph's batch holds `DeviceSlots` (IO binding) on the CPU, its
    departures moving rows in them."""
    from service.runtime.device_slots import DeviceSlots

    moved: list[int] = []
    move_rows = DeviceSlots.move_rows
    monkeypatch.setattr(DeviceSlots, "move_rows",
                        lambda self, sources, *args, **kwargs: moved.append(len(sources)) or move_rows(self, sources, *args, **kwargs))
    models, data = tiny_bench_dirs
    out = tmp_path / "join_cost.json"
    assert main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
                 "--sentences", "30", "--rows", "8", "--group", "3", "--repeats", "1", "--modes", STEP_MODE,
                 "--device-slots", "--variant", "fp32"]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["device_slots"] is True and results["variant"] == "fp32"
    median = results["modes"][STEP_MODE]["median"]
    assert median["leaves"] > 0 and moved
    assert median["join_s"] > median["encode_s"] > 0 and median["encodes"] == median["joins"]  # one encoder call a join


def test_the_replay_never_holds_more_than_its_rows(tiny_runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Joins of `group` stop at `rows`: a batch of 5 rows joining in threes takes 3, then 2."""
    from service.batching.slot_batch import SlotBatch

    sizes: list[int] = []
    step = SlotBatch.generate_token

    def counted(self: SlotBatch) -> list:
        sizes.append(len(self))
        return step(self)

    monkeypatch.setattr(SlotBatch, "generate_token", counted)
    sources = [[5 + i % 7, 6, 7, 3] for i in range(12)]
    result = replay(tiny_runtime, sources, 5, 3, MODES[STEP_MODE])
    assert max(sizes) == 5 and sizes[:2] == [3, 5] and result["steps"] == len(sizes)
    assert result["joins"] >= 4  # 12 sources, at most 3 a join
