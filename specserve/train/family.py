"""The reference model families: tokenizer, target and every drafter, built by one command.

    python -m specserve.train.family --family embedded|gpu --out DIR [--device cuda] [--minutes M]

Each stage is cached in DIR and skipped when its output exists, so an interrupted build resumes:

    DIR/tokenizer/            byte-level BPE (HF files)
    DIR/tokens_train.npy      the encoded training stream
    DIR/target/               the Llama target (HF layout, tokenizer files included)
    DIR/target_train.json     its loss curve and throughput; DIR/target_loss.png
    DIR/drafters/<method>/    one drafter per method, trained by `train_drafter`
    DIR/summary.json          acceptance length of every drafter on the held-out code prompts

The presets (`embedded`, small enough to ship inside the package and run on a CPU; `gpu`, the ~100M
target the GPU benchmarks use) are in `presets.py`, the engine-side measurements in `evaluate.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from specserve.train import corpus
from specserve.train.evaluate import (
    complete_function,
    evaluate_acceptance,
    fraction_parsing,
    free_memory,
    parses,
    spec_config_for,
)
from specserve.train.presets import FAMILIES, FamilySpec
from specserve.train.reference import llama_config, plot_losses, save_hf, train_reference
from specserve.train.tokenizer import (
    BOS,
    encode_documents,
    render_chat,
    special_ids,
    train_tokenizer,
)

# Presets and evaluation helpers are re-exported: benchmarks and tests import them from here.
__all__ = [
    "FAMILIES",
    "STAGES",
    "FamilySpec",
    "available_methods",
    "build_family",
    "complete_function",
    "evaluate_acceptance",
    "evaluate_family",
    "format_table",
    "fraction_parsing",
    "free_memory",
    "parses",
    "spec_config_for",
    "with_overrides",
]

STAGES = ("tokenizer", "target", "drafters", "eval")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ---- stages -------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[family {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _train_files(spec: FamilySpec, limit: int | None = None) -> list[corpus.SourceFile]:
    return corpus.load_corpus(
        "train", packages=spec.packages, max_bytes=spec.corpus_max_bytes, limit=limit
    )


def _by_hash(files: list[corpus.SourceFile], max_bytes: int) -> list[str]:
    """Texts of a hash-ordered sample of `files` up to `max_bytes`: a spread over the corpus."""
    out, used = [], 0
    for f in sorted(files, key=lambda f: corpus.stable_hash(f.path)):
        if used >= max_bytes:
            break
        out.append(f.text)
        used += len(f.text)
    return out


def build_tokenizer(spec: FamilySpec, out: str, files: list[corpus.SourceFile]) -> str:
    tok_dir = os.path.join(out, "tokenizer")
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        _log(f"tokenizer: BPE {spec.shape.vocab_size} on {spec.tokenizer_max_bytes / 1e6:.0f} MB")
        train_tokenizer(_by_hash(files, spec.tokenizer_max_bytes), spec.shape.vocab_size, tok_dir)
    return tok_dir


def build_tokens(spec: FamilySpec, out: str, tok_dir: str, files: list[corpus.SourceFile]) -> Any:
    path = os.path.join(out, "tokens_train.npy")
    if os.path.isfile(path):
        return np.load(path)
    t0 = time.perf_counter()
    code = encode_documents(tok_dir, [f.text for f in files], add_bos=True)
    chats = [render_chat(m) for m in corpus.chat_examples(files, spec.max_chat_examples)]
    chat = encode_documents(tok_dir, chats, add_bos=False)
    tokens = np.concatenate([code, chat])
    np.save(path, tokens)
    _log(
        f"corpus: {len(files)} files, {corpus.corpus_bytes(files) / 1e6:.0f} MB, {len(chats)} chat "
        f"examples -> {len(tokens) / 1e6:.1f}M tokens in {time.perf_counter() - t0:.0f}s"
    )
    return tokens


def build_target(
    spec: FamilySpec, out: str, tok_dir: str, tokens: Any, device: str, progress: bool
) -> str:
    target = os.path.join(out, "target")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    cfg = llama_config(spec.shape, special_ids(tok_dir), spec.save_dtype)
    _log(f"target: {spec.shape} on {device}, {spec.train}")
    model, record = train_reference(cfg, tokens, spec.train, device, progress)
    # Written to a temporary dir and renamed: a killed run never leaves a half-saved target.
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, cfg, tmp, spec.save_dtype)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tok_dir, name), tmp)
    os.replace(tmp, target)
    del model
    free_memory(device)
    with open(os.path.join(out, "target_train.json"), "w") as f:
        json.dump({"shape": spec.shape.__dict__, "train": spec.train.__dict__, **record}, f)
    plot_losses(record["losses"], os.path.join(out, "target_loss.png"), f"{spec.name} target")
    return target


def drafter_texts(spec: FamilySpec, files: list[corpus.SourceFile]) -> list[str]:
    """Drafter training text: a hash-ordered sample of the code plus some chat examples (without
    the bos token, which the drafter trainer's tokenizer adds), so chat serving drafts well too."""
    code = _by_hash(files, spec.drafter_text_bytes * 7 // 8)
    chats = []
    budget = spec.drafter_text_bytes // 8
    for m in corpus.chat_examples(files, spec.max_chat_examples // 4):
        chats.append(render_chat(m).removeprefix(BOS))
        budget -= len(chats[-1])
        if budget <= 0:
            break
    return code + chats


def available_methods() -> tuple[str, ...]:
    from specserve.train.drafter import METHODS

    return tuple(METHODS)


def build_drafters(
    spec: FamilySpec,
    out: str,
    target: str,
    files: list[corpus.SourceFile],
    device: str,
    methods: list[str],
    progress: bool,
) -> dict[str, str]:
    from specserve.train.drafter import train_drafter

    dirs = {m: os.path.join(out, "drafters", m) for m in methods}
    todo = [m for m in methods if not os.path.isfile(os.path.join(dirs[m], "model.safetensors"))]
    texts = drafter_texts(spec, files) if todo else []
    for method in todo:
        d = dirs[method]
        kwargs = {**spec.drafters.get(method, {}), "eval_k": spec.num_speculative_tokens}
        _log(f"drafter {method}: {kwargs}")
        tmp = d + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        res = train_drafter(
            target,
            method,
            tmp,
            texts,
            eval_prompts=[],
            device=device,
            seed=spec.train.seed,
            progress=progress,
            **kwargs,
        )
        os.replace(tmp, d)
        free_memory(device)
        secs = res.get("train_seconds", float("nan"))
        _log(f"drafter {method}: {len(res['losses'])} steps in {secs:.0f}s")
    return dirs


# ---- evaluation ---------------------------------------------------------------------------------
def evaluate_family(
    spec: FamilySpec, out: str, target: str, drafters: dict[str, str], device: str
) -> dict[str, Any]:
    from specserve.data import load_prompts

    prompts = [r["prompt"] for r in load_prompts("code", spec.eval_num_prompts)]
    k = spec.num_speculative_tokens
    setting = {"K": k, "num_prompts": len(prompts), "max_tokens": spec.eval_max_tokens}
    os.makedirs(os.path.join(out, "eval"), exist_ok=True)
    results = {}
    for method in [*drafters, "ngram"]:
        # Cached per method: a later call that adds drafters re-evaluates only those.
        path = os.path.join(out, "eval", f"{method}.json")
        if os.path.isfile(path):
            with open(path) as f:
                cached = json.load(f)
            if cached["setting"] == setting:
                results[method] = cached["result"]
                continue
        parse = prompts[: spec.parse_num_prompts] if method == "eagle3" else None
        cfg = spec_config_for(method, drafters.get(method), k)
        results[method] = evaluate_acceptance(
            target, cfg, prompts, spec.eval_max_tokens, device, parse
        )
        with open(path, "w") as f:
            json.dump({"setting": setting, "result": results[method]}, f)
        _log(f"eval {method}: {results[method]}")
    return {**setting, "methods": results}


# ---- the whole family ---------------------------------------------------------------------------
def dir_bytes(path: str, names: tuple[str, ...] | None = None) -> int:
    if not os.path.isdir(path):
        return 0
    return sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if names is None or n in names
    )


def build_family(
    spec: FamilySpec,
    out: str,
    device: str = "cuda",
    stages: tuple[str, ...] = STAGES,
    methods: list[str] | None = None,
    progress: bool = True,
    corpus_limit: int | None = None,
) -> dict[str, Any]:
    """Build (or resume) the family in `out`; returns the summary also written to summary.json."""
    bad = set(stages) - set(STAGES)
    if bad:
        raise ValueError(f"unknown stage(s) {sorted(bad)}; stages are {', '.join(STAGES)}")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    files = _train_files(spec, corpus_limit)
    tok_dir = build_tokenizer(spec, out, files)
    target = os.path.join(out, "target")
    if "target" in stages or "tokenizer" in stages:
        tokens = build_tokens(spec, out, tok_dir, files)
    if "target" in stages:
        target = build_target(spec, out, tok_dir, tokens, device, progress)
    methods = methods or [m for m in spec.drafters if m in available_methods()]
    drafters: dict[str, str] = {}
    if "drafters" in stages or "eval" in stages:
        if not os.path.isfile(os.path.join(target, "model.safetensors")):
            raise FileNotFoundError(f"{target}: no target yet; run the 'target' stage first")
        want = methods if "drafters" in stages else []
        drafters = build_drafters(spec, out, target, files, device, want, progress)
        for m in available_methods():  # and those an earlier call built
            if os.path.isfile(os.path.join(out, "drafters", m, "model.safetensors")):
                drafters[m] = os.path.join(out, "drafters", m)
    summary = _summary(spec, out, target, drafters, device)
    if "eval" in stages:
        summary["eval"] = evaluate_family(spec, out, target, drafters, device)
    summary["build_seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _summary(
    spec: FamilySpec, out: str, target: str, drafters: dict[str, str], device: str
) -> dict[str, Any]:
    s: dict[str, Any] = {
        "family": spec.name,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "target_bytes": dir_bytes(target),
        "drafter_bytes": {
            m: dir_bytes(d, ("config.json", "model.safetensors")) for m, d in drafters.items()
        },
    }
    rec_path = os.path.join(out, "target_train.json")
    if os.path.isfile(rec_path):
        with open(rec_path) as f:
            rec = json.load(f)
        s["target"] = {k: v for k, v in rec.items() if k != "losses"}
        s["target"]["final_loss"] = float(np.mean(rec["losses"][-50:]))
    return s


def format_table(summary: dict[str, Any]) -> str:
    rows = [f"family {summary['family']} on {summary['device']}"]
    t = summary.get("target")
    if t:
        rows.append(
            f"target {t['params'] / 1e6:.1f}M params  {t['steps']} steps  "
            f"{t['tokens_per_s']:,.0f} tok/s  {t['seconds']:.0f}s  loss {t['final_loss']:.3f}  "
            f"{summary['target_bytes'] / 1e6:.1f} MB"
        )
    ev = summary.get("eval")
    if ev:
        rows.append(f"{'method':<8} {'accept len (K=' + str(ev['K']) + ')':>20} {'parse':>6}")
        for m, r in ev["methods"].items():
            parse = r.get("fraction_parsing")
            rows.append(
                f"{m:<8} {r['acceptance_length']:>20.3f} {'' if parse is None else f'{parse:.2f}':>6}"
            )
    return "\n".join(rows)


def with_overrides(
    spec: FamilySpec,
    device: str,
    minutes: float | None = None,
    steps: int | None = None,
    drafter_steps: int | None = None,
) -> FamilySpec:
    """The preset with command-line overrides (a time cap, step counts for a quick smoke run);
    eager off CUDA."""
    train = spec.train
    if minutes is not None:
        train = replace(train, max_minutes=minutes)
    if steps is not None:
        train = replace(train, max_steps=steps, warmup_steps=min(train.warmup_steps, steps))
    if not device.startswith("cuda"):
        train = replace(train, compile=False)
    drafters = spec.drafters
    if drafter_steps is not None:
        drafters = {m: {**kw, "steps": drafter_steps} for m, kw in drafters.items()}
    return replace(spec, train=train, drafters=drafters)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), required=True)
    p.add_argument("--out", required=True, help="family directory (cached: existing parts stay)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, help="wall-clock cap on the target's training")
    p.add_argument("--steps", type=int, help="target training steps (default: the preset's)")
    p.add_argument("--drafter-steps", type=int, help="steps of every drafter (smoke runs)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ",".join(STAGES))
    p.add_argument("--methods", help="comma list of drafter methods (default: every one)")
    p.add_argument("--no-compile", action="store_true", help="train the target eagerly")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    spec = with_overrides(
        FAMILIES[args.family], args.device, args.minutes, args.steps, args.drafter_steps
    )
    if args.no_compile:
        spec = replace(spec, train=replace(spec.train, compile=False))
    summary = build_family(
        spec,
        args.out,
        args.device,
        tuple(s for s in args.stages.split(",") if s),
        args.methods.split(",") if args.methods else None,
        not args.no_progress,
    )
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
