"""Build a vocabulary shortlist (`service.runtime.shortlist`): the lexical table from training
pairs, and the graphs whose output projection computes only the shortlist's columns.

The table: both sides of every training pair are tokenized with the model's own SentencePiece
model; for each source piece s and target piece t, c(s, t) counts the pairs whose source holds s
and whose target holds t (sentence co-occurrence, each piece once per sentence). Each source
piece keeps its K target pieces of highest association score (`SCORES`), ties broken by the
smaller id; every shortlist also holds the N most frequent target pieces (by token count) and
the special ids EOS and UNK.

The graphs: `shortlist_graphs` splits a step graph (`export.step_graph`) in two. Every constant
whose last axis is the vocabulary and that is read by the output projection or by the nodes
between it and `logits` (the int8 graph's quantized weight [d, V], its per-channel zero points
and scales [V]; the fp32 graph's weight [d, V]) becomes an input of the step graph, and the
projection graph makes those inputs from `vocab` by `Gather(constant, vocab, axis=-1)`. A
[d, V] weight is stored transposed, [V, d], and gathered along its first axis then transposed
back: a Gather along the last axis copies one element at a time. The projection graph runs
when a batch's shortlist changes, the step graph at every step; with `vocab` holding every id
in order they compute the original logits.

    python -m export.shortlist table --model models/translate-en-it --data-dir DATA --out table.npz -k 20 -n 500
    python -m export.shortlist graph --step models/translate-en-it/int8/decoder_step.onnx --out DIR
    python -m export.shortlist coverage --model models/translate-en-it --data-dir DATA --table table.npz

`add_shortlist` (`attnserve add-shortlist`) puts them into a model repository for its int8
variant: the table beside the tokenizer, the graphs beside the variant's step graph, sharing its
`weights.bin` (only the projection's weight stored by vocabulary row is added); it measures the
cost on the test split with each sentence decoded alone (a row's own shortlist, the smallest a
step uses) and refuses a shortlist that costs more than `MAX_SHORTLIST_DROP` points on any metric.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.quality import METRICS
from export.repository import MAX_SIZE_MB, repository_size_mb
from export.storage import WEIGHTS_FILE, add_graphs, load_graph
from model.evaluation import rouge_scores, translation_scores
from model.run_config import read_split
from model.tokenizer import Tokenizer
from service.repository.manifest import MANIFEST_FILE, read_manifest, verify_files, write_manifest
from service.runtime import CPU, ModelRuntime
from service.runtime.shortlist import ShortlistTable

log = logging.getLogger(__name__)

SHORTLIST_STEP_FILE = "decoder_step_shortlist.onnx"
SHORTLIST_PROJECTION_FILE = "shortlist_projection.onnx"
SHORTLIST_TABLE_FILE = "shortlist.npz"
MAX_SHORTLIST_DROP = 0.1  # points on any quality metric a served shortlist may cost (one sentence at a time)
SCORES = ("dice", "lift")  # dice: 2 c(s,t) / (c(s) + c(t)); lift: c(s,t) / c(s) - c(t) / pairs
CHUNK = 20_000  # pairs counted per batch of pair codes


def cooccurrence(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                 vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sentence co-occurrence counts of tokenized pairs: c(s, t) (vocab, vocab) int32, the number
    of sources holding s and of targets holding t (vocab,) each, and each target piece's token
    count (vocab,)."""
    counts = np.zeros((vocab, vocab), dtype=np.int32)
    source_df = np.zeros(vocab, dtype=np.int64)
    target_df = np.zeros(vocab, dtype=np.int64)
    target_tf = np.zeros(vocab, dtype=np.int64)
    for start in range(0, len(sources), CHUNK):
        codes = []
        for source, target in zip(sources[start:start + CHUNK], targets[start:start + CHUNK], strict=True):
            s = np.unique(np.asarray(source, dtype=np.int64))
            t = np.unique(np.asarray(target, dtype=np.int64))
            source_df[s] += 1
            target_df[t] += 1
            np.add.at(target_tf, np.asarray(target, dtype=np.int64), 1)
            codes.append((s[:, None] * vocab + t[None, :]).ravel())
        if codes:
            pairs, hits = np.unique(np.concatenate(codes), return_counts=True)
            counts.ravel()[pairs] += hits.astype(np.int32)
    return counts, source_df, target_df, target_tf


def association(counts: np.ndarray, source_df: np.ndarray, target_df: np.ndarray, pairs: int,
                score: str, rows: slice) -> np.ndarray:
    """Association scores (float32) of the source pieces `rows` with every target piece."""
    c = counts[rows].astype(np.float32)
    if score == "dice":
        return 2 * c / np.maximum(source_df[rows, None] + target_df[None, :], 1).astype(np.float32)
    if score == "lift":
        return c / np.maximum(source_df[rows, None], 1).astype(np.float32) - (target_df / max(pairs, 1)).astype(np.float32)
    raise ValueError(f"unknown score {score!r} (one of {SCORES})")


def top_candidates(counts: np.ndarray, source_df: np.ndarray, target_df: np.ndarray, pairs: int,
                   k: int, score: str) -> np.ndarray:
    """Each source piece's `k` target pieces of highest score, best first (vocab, k); pieces never
    seen with it score below every seen one and come after them, smaller ids first."""
    vocab = len(counts)
    out = np.zeros((vocab, k), dtype=np.int64)
    step = 512
    for start in range(0, vocab, step):
        rows = slice(start, min(start + step, vocab))
        scores = association(counts, source_df, target_df, pairs, score, rows)
        scores[counts[rows] == 0] = -np.inf
        # a stable sort of the negated scores: the best first, ties by the smaller id
        out[rows] = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return out


def build_table(tokenizer: Tokenizer, sources: Sequence[str], targets: Sequence[str], k: int,
                frequent: int, score: str = "dice") -> ShortlistTable:
    """The table of `k` candidates per source piece and the `frequent` most frequent target
    pieces plus EOS and UNK, from raw training pairs."""
    source_ids = tokenizer.encode_batch(sources)
    target_ids = tokenizer.encode_batch(targets)
    return table_from_ids(source_ids, target_ids, tokenizer.vocab_size, k, frequent,
                          [tokenizer.eos_id, tokenizer.unk_id], score)


def table_from_ids(source_ids: Sequence[Sequence[int]], target_ids: Sequence[Sequence[int]], vocab: int,
                   k: int, frequent: int, specials: Sequence[int], score: str = "dice") -> ShortlistTable:
    """`build_table` on tokenized pairs."""
    counts, source_df, target_df, target_tf = cooccurrence(source_ids, target_ids, vocab)
    candidates = top_candidates(counts, source_df, target_df, len(source_ids), k, score)
    top = np.argsort(-target_tf, kind="stable")[:frequent]
    always = np.unique(np.concatenate([top, np.asarray(list(specials), dtype=np.int64)]))
    return ShortlistTable(candidates, always)


def save_table(table: ShortlistTable, path: str | Path) -> None:
    """Write the table as `.npz` (int16 ids when the vocabulary fits, else int32)."""
    dtype = np.int16 if table.vocab_size <= np.iinfo(np.int16).max + 1 else np.int32
    np.savez(Path(path), candidates=table.candidates.astype(dtype), always=table.always.astype(dtype))


def coverage(table: ShortlistTable, sources: Sequence[Sequence[int]],
             references: Sequence[Sequence[int]]) -> dict[str, float]:
    """How well each source's own shortlist (its candidates and `always`) holds its reference:
    the share of reference tokens in it, the share of references held whole, and the mean
    shortlist size."""
    held = total = whole = 0
    sizes = []
    for source, reference in zip(sources, references, strict=True):
        shortlist = table.shortlist([source])
        inside = np.isin(np.asarray(reference, dtype=np.int64), shortlist)
        held += int(inside.sum())
        total += len(reference)
        whole += bool(inside.all())
        sizes.append(len(shortlist))
    return {"token_coverage": held / max(total, 1), "sentence_coverage": whole / max(len(sources), 1),
            "mean_shortlist": float(np.mean(sizes)) if sizes else 0.0}


def _projection_constants(graph: onnx.GraphProto, vocab: int) -> list[tuple[onnx.NodeProto, int, str]]:
    """(node, input index, initializer) of every initializer with last axis `vocab` read by the
    nodes from `logits` back to the output projection (the first MatMul/MatMulInteger met) and
    by the nodes that feed those."""
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {init.name: init for init in graph.initializer}
    found: list[tuple[onnx.NodeProto, int, str]] = []
    chain: list[onnx.NodeProto] = []
    node = producers.get("logits")
    while node is not None:
        chain.append(node)
        if node.op_type in ("MatMul", "MatMulInteger"):
            break
        # the next node up: the producer of the input that is no initializer and carries the vocabulary
        inputs = [name for name in node.input if name in producers and name not in initializers]
        node = producers[inputs[0]] if inputs else None
    else:
        raise ValueError("no MatMul/MatMulInteger found above `logits`")
    readers = list(chain)
    for node in chain:  # one level up: the per-channel scale's Mul, for instance
        readers += [producers[name] for name in node.input if name in producers and producers[name] not in readers]
    for node in readers:
        for index, name in enumerate(node.input):
            init = initializers.get(name)
            if init is not None and len(init.dims) and init.dims[-1] == vocab and not (
                    node.op_type == "Gather" and index == 1):
                found.append((node, index, name))
    if not any(node.op_type in ("MatMul", "MatMulInteger") for node, _, _ in found):
        raise ValueError("the output projection's weight is no initializer of last axis vocab")
    return found


def shortlist_graphs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The shortlist's two graphs from step graph `model`: (step, projection).

    projection: input `vocab` (V',) int64; an output per constant of the output projection with
    last axis vocab (`_projection_constants`), its columns `vocab` (a [d, V] weight stored
    [V, d], gathered by rows, then transposed back to [d, V']).
    step: a copy of `model` reading those outputs as inputs of the same names in place of the
    constants, so `logits` is (B, V'), the columns `vocab`. The projection runs once per new
    shortlist, the step once per step: the gather is not paid at every step."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    logits = next(o for o in graph.output if o.name == "logits")
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    if not vocab:
        raise ValueError("`logits` has no fixed vocabulary dimension")
    gathered: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    columns: list[onnx.ValueInfoProto] = []
    for node, index, name in _projection_constants(graph, vocab):
        if name not in gathered:
            init = next(i for i in graph.initializer if i.name == name)
            gathered[name] = f"{name}.shortlist"
            if len(init.dims) == 2:
                # a (d, V) weight is stored (V, d): Gather then copies whole rows, not single
                # elements; a Transpose gives the projection its (d, V') back
                rows = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(init).T),
                                               f"{name}.by_vocab")
                constants.append(rows)
                nodes.append(helper.make_node("Gather", [rows.name, "vocab"], [f"{rows.name}.shortlist"], axis=0,
                                              name=f"shortlist_gather_{len(nodes)}"))
                nodes.append(helper.make_node("Transpose", [f"{rows.name}.shortlist"], [gathered[name]],
                                              perm=[1, 0], name=f"shortlist_transpose_{len(nodes)}"))
                shape: list[int | str] = [init.dims[0], "shortlist"]
            else:
                constants.append(init)
                nodes.append(helper.make_node("Gather", [name, "vocab"], [gathered[name]], axis=len(init.dims) - 1,
                                              name=f"shortlist_gather_{len(nodes)}"))
                shape = [*init.dims[:-1], "shortlist"]
            columns.append(helper.make_tensor_value_info(gathered[name], init.data_type, shape))
        node.input[index] = gathered[name]
    used = {name for node in graph.node for name in node.input}  # a weight read only by the projection goes
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(columns)
    logits.type.tensor_type.shape.dim[-1].ClearField("dim_value")
    logits.type.tensor_type.shape.dim[-1].dim_param = "shortlist"
    del graph.value_info[:]  # shapes inferred for the full vocabulary no longer hold
    onnx.checker.check_model(out)
    projection = helper.make_model(
        helper.make_graph(nodes, "shortlist_projection",
                          [helper.make_tensor_value_info("vocab", TensorProto.INT64, ["shortlist"])],
                          columns, [_copy(c) for c in constants]),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    onnx.checker.check_model(projection)
    return out, projection


def _copy(tensor: onnx.TensorProto) -> onnx.TensorProto:
    copied = onnx.TensorProto()
    copied.CopyFrom(tensor)
    return copied


def write_shortlist_graphs(step: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `shortlist_graphs` of the step graph at `step` into `out_dir` (`SHORTLIST_STEP_FILE`,
    `SHORTLIST_PROJECTION_FILE`), their weights inline (the source graph's external weights are
    read, the source is left unchanged); returns their paths."""
    model = onnx.load(str(step), load_external_data=True)
    graphs = shortlist_graphs(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / SHORTLIST_STEP_FILE, out_dir / SHORTLIST_PROJECTION_FILE
    for graph, path in zip(graphs, paths, strict=True):
        onnx.save_model(graph, str(path))
    return paths


class ShortlistTooCostly(ValueError):
    """The shortlist costs more than the bound on the test split."""


def decode_alone(runtime: ModelRuntime, sources: Sequence[Sequence[int]], shortlist: bool) -> list[list[int]]:
    """Each source's greedy tokens decoded alone through a `SlotBatch` of one row, over the
    runtime's shortlist (its own candidates and `always`) or the whole vocabulary."""
    from service.batching.slot_batch import generate_running

    alone = 1 if shortlist else 0  # the shortlist's rule: steps of at most this many rows
    return [next(iter(generate_running(runtime, [(0, list(source))], rows=1, shortlist_rows=alone)))[1].tokens
            for source in sources]


def shortlist_quality(runtime: ModelRuntime, data_dir: str | Path, rows: int | None,
                      split: str = "test") -> dict[str, Any]:
    """The task's metrics of greedy outputs on the first `rows` of `split` (all: None), each
    sentence decoded alone with the whole vocabulary and with its shortlist; the share of
    identical outputs, the mean shortlist and each pass's seconds."""
    assert runtime.shortlist is not None
    texts, references = read_split(data_dir, split)
    texts, references = texts[:rows], references[:rows]
    keep, eos = runtime.max_source_len - 1, runtime.eos_id
    sources = [ids[:keep] + [eos] for ids in runtime.tokenizer.encode_batch(texts)]
    score = translation_scores if runtime.task == "translate" else rouge_scores
    report: dict[str, Any] = {"split": split, "rows": len(sources), "decoding": "greedy, one sentence at a time"}
    outputs = {}
    for name in ("full", "shortlist"):
        started = time.perf_counter()
        outputs[name] = decode_alone(runtime, sources, name == "shortlist")
        report[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
        report[name] = dict(score([runtime.tokenizer.decode(t) for t in outputs[name]], references))
    report["identical"] = round(sum(a == b for a, b in zip(outputs["full"], outputs["shortlist"], strict=True))
                                / max(len(sources), 1), 4)
    report["mean_shortlist"] = round(float(np.mean([len(runtime.shortlist.table.shortlist([s])) for s in sources]))
                                     if sources else 0.0, 1)
    return report


def add_shortlist(directory: str | Path, data_dir: str | Path, *, precision: str = "int8", k: int = 20,
                  frequent: int = 500, score: str = "dice", rows: int | None = None,
                  max_drop: float | None = MAX_SHORTLIST_DROP, max_size_mb: float | None = MAX_SIZE_MB,
                  threads: int = 0) -> dict[str, Any]:
    """Give the `precision` variant of the repository `directory` a vocabulary shortlist: the
    table from `data_dir`'s training pairs (tokenized by the repository's tokenizer) written as
    `shortlist.npz`, and `shortlist_graphs` of the variant's step graph written beside it, their
    weights shared with the variant's `weights.bin`; the cost measured on the first `rows`
    test rows (`shortlist_quality`) and recorded with them as the variant's `shortlist`. Refused
    (the repository left as it was) when the variant has no step graph or has a shortlist
    already, when a metric drops more than `max_drop` points, or when the repository grows over
    `max_size_mb`. Returns the manifest's new `shortlist` entry."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    variant = manifest.variant(precision)
    if not variant.step_decoder:
        raise ValueError(f"{directory}: the {precision} variant has no step graph")
    if variant.shortlist:
        raise ValueError(f"{directory}: the {precision} variant has a shortlist already "
                         f"({variant.shortlist['step_decoder']})")
    if manifest.tokenizer_kind != "sentencepiece":  # one SentencePiece model for both sides
        raise ValueError(f"{directory}: the table needs one SentencePiece tokenizer for sources and targets, "
                         f"not {manifest.tokenizer_kind!r}")
    step = PurePosixPath(variant.step_decoder)
    graph_name, projection_name = (str(step.parent / file) if step.parent.parts else file
                                   for file in (SHORTLIST_STEP_FILE, SHORTLIST_PROJECTION_FILE))
    weights = directory / step.parent / WEIGHTS_FILE
    manifest_text = (directory / MANIFEST_FILE).read_bytes()
    weights_size = weights.stat().st_size if weights.exists() else None
    tokenizer = Tokenizer.from_file(directory / manifest.tokenizer)
    sources, targets = read_split(data_dir, "train")
    table = table_from_ids(tokenizer.encode_batch(sources), tokenizer.encode_batch(targets), tokenizer.vocab_size,
                           k, frequent, [tokenizer.eos_id, tokenizer.unk_id], score)
    try:
        save_table(table, directory / SHORTLIST_TABLE_FILE)
        step_graph, projection = shortlist_graphs(load_graph(directory / step))
        add_graphs(directory / step.parent, {SHORTLIST_STEP_FILE: step_graph, SHORTLIST_PROJECTION_FILE: projection})
        entry: dict[str, Any] = {"step_decoder": graph_name, "projection": projection_name,
                                 "table": SHORTLIST_TABLE_FILE, "score": score, "k": k, "n": frequent,
                                 "train_pairs": len(sources)}
        variant.shortlist = entry
        write_manifest(directory, manifest)
        runtime = ModelRuntime.load(directory, [CPU], threads=threads, variant=precision, step_graph=True,
                                    shortlist=True)
        entry["quality"] = quality = shortlist_quality(runtime, data_dir, rows)
        drops = {m: round(quality["full"][m] - quality["shortlist"][m], 2) for m in METRICS[manifest.task]}
        if max_drop is not None and max(drops.values()) > max_drop:
            raise ShortlistTooCostly(f"the shortlist costs {drops} points (bound {max_drop})")
        size = repository_size_mb(directory)
        if max_size_mb is not None and size > max_size_mb:
            raise ValueError(f"{directory}: {size:.1f} MB with the shortlist, over {max_size_mb:g} MB")
        manifest.exporter["size_mb"] = round(size, 1)
        write_manifest(directory, manifest)
    except BaseException:
        for name in (SHORTLIST_TABLE_FILE, graph_name, projection_name):
            (directory / name).unlink(missing_ok=True)
        if weights_size is None:
            weights.unlink(missing_ok=True)
        else:
            with weights.open("r+b") as file:
                file.truncate(weights_size)
        (directory / MANIFEST_FILE).write_bytes(manifest_text)
        raise
    log.info("%s: added the %s variant's vocabulary shortlist (%s)", directory, precision, entry["quality"])
    return entry


def _tokenized_split(model_dir: Path, data_dir: Path, split: str, rows: int | None) -> tuple[Tokenizer, list[list[int]], list[list[int]]]:
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.model")
    sources, targets = read_split(data_dir, split)
    if rows is not None:
        sources, targets = sources[:rows], targets[:rows]
    return tokenizer, tokenizer.encode_batch(sources), tokenizer.encode_batch(targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("table", help="build the lexical table from the training pairs")
    table.add_argument("--model", type=Path, required=True, help="model repository (its tokenizer.model)")
    table.add_argument("--data-dir", type=Path, required=True, help="folder of train.src/train.tgt")
    table.add_argument("--out", type=Path, required=True)
    table.add_argument("-k", type=int, default=20, help="candidates per source piece")
    table.add_argument("-n", type=int, default=500, help="most frequent target pieces in every shortlist")
    table.add_argument("--score", choices=SCORES, default="dice")
    graph = commands.add_parser("graph", help="the shortlist's step and projection graphs")
    graph.add_argument("--step", type=Path, required=True)
    graph.add_argument("--out", type=Path, required=True, help="folder to write them into")
    cover = commands.add_parser("coverage", help="reference tokens held by their sources' shortlists")
    cover.add_argument("--model", type=Path, required=True)
    cover.add_argument("--data-dir", type=Path, required=True)
    cover.add_argument("--table", type=Path, required=True)
    cover.add_argument("--split", default="test")
    args = parser.parse_args(argv)
    if args.command == "table":
        tokenizer, sources, targets = _tokenized_split(args.model, args.data_dir, "train", None)
        built = table_from_ids(sources, targets, tokenizer.vocab_size, args.k, args.n,
                               [tokenizer.eos_id, tokenizer.unk_id], args.score)
        save_table(built, args.out)
    elif args.command == "graph":
        write_shortlist_graphs(args.step, args.out)
    else:
        _, sources, references = _tokenized_split(args.model, args.data_dir, args.split, None)
        result: dict[str, Any] = coverage(ShortlistTable.load(args.table), sources, references)
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
