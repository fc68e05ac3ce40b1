"""Build a reference model family on a GPU machine and bring back what must be committed.

Runs from the repository root on a bare GPU machine (10 minutes a command, only files written
under $OUT come back: at most 8, each under 16 MB). Every stage is cached in --cache, which
survives between calls while the machine stays warm.

    # Embedded family (~7 min on an H100): tokenizer, target, EAGLE-3 head, evaluation. $OUT gets
    # embedded.tar.part00, .part01 (the files to commit, split under 16 MB), summary.json and the
    # loss curves.
    python benchmarks/build_family.py --family embedded
    # ... optionally, next call on the same warm machine: the other drafters, for RESULTS.md
    python benchmarks/build_family.py --family embedded --methods eagle,mtp,ptd

    # GPU family (~100M target), cached in /tmp/family across calls on the same warm machine
    # (it goes back after 30 s idle: issue the calls back to back):
    python benchmarks/build_family.py --family gpu --cache /tmp/family --stages tokenizer,target
    python benchmarks/build_family.py --family gpu --cache /tmp/family --methods eagle3
    python benchmarks/build_family.py --family gpu --cache /tmp/family --methods eagle,mtp,ptd

    # Here, after the embedded run: check and unpack the parts into specserve/data/embedded
    python benchmarks/build_family.py --install DIR_WITH_THE_PARTS

    # The default model's EAGLE-3 head (SmolLM2-135M-Instruct from its GGUF, ~6 min on an H100):
    # self-distilled replies to data/instruct_prompts.jsonl (+ the chat and code prompts), the
    # head trained on them, acceptance on the held-out prompts; $OUT gets smollm2_eagle3.tar.partNN
    python benchmarks/build_family.py --family smollm2 --gguf PATH.gguf
    # Here: unpack them into specserve/data/smollm2_eagle3
    python benchmarks/build_family.py --install DIR_WITH_THE_PARTS --family smollm2

Prints a short table last.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from a bare checkout: no install needed

EMBEDDED_LIMIT = 25_000_000  # bytes of committed model files
PART_BYTES = 15_000_000  # under the 16 MB a returned file may have
TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
DRAFTER_FILES = ("config.json", "model.safetensors")


def package_members(family_dir: str) -> list[tuple[str, str]]:
    """(name in the archive, file on disk) of the embedded package: target + EAGLE-3 head."""
    if os.path.isfile(os.path.join(family_dir, "smollm2.json")):  # the default model's head
        return [(f"eagle3/{n}", os.path.join(family_dir, "eagle3", n)) for n in DRAFTER_FILES]
    out = [(f"target/{n}", os.path.join(family_dir, "target", n)) for n in TARGET_FILES]
    out += [
        (f"eagle3/{n}", os.path.join(family_dir, "drafters", "eagle3", n)) for n in DRAFTER_FILES
    ]
    missing = [p for _, p in out if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"cannot package the embedded family: missing {missing}")
    return out


def pack(
    family_dir: str, out_dir: str, part_bytes: int = PART_BYTES, prefix: str = "embedded"
) -> dict[str, object]:
    """Write <prefix>.tar.partNN files (a reproducible tar, split) and return its manifest."""
    members = package_members(family_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = os.path.getsize(path), 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = buf.getvalue()
    parts = []
    for i in range(0, len(data), part_bytes):
        name = f"{prefix}.tar.part{i // part_bytes:02d}"
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data[i : i + part_bytes])
        parts.append(name)
    model_bytes = sum(os.path.getsize(p) for _, p in members)
    manifest = {
        "parts": parts,
        "sha256": hashlib.sha256(data).hexdigest(),
        "tar_bytes": len(data),
        "model_bytes": model_bytes,
        "files": {n: os.path.getsize(p) for n, p in members},
    }
    with open(os.path.join(out_dir, f"{prefix}_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    if model_bytes > EMBEDDED_LIMIT:
        print(f"WARNING: embedded files are {model_bytes / 1e6:.1f} MB, over the 25 MB limit")
    return manifest


def install(src_dir: str, dest: str | None = None, prefix: str = "embedded") -> str:
    """Join and check the parts in `src_dir`, then unpack them into specserve/data/embedded
    (prefix "smollm2_eagle3": the default model's head, into specserve/data/smollm2_eagle3)."""
    if dest is None:
        sub = "embedded" if prefix == "embedded" else prefix
        dest = os.path.join(ROOT, "specserve", "data", sub)
    with open(os.path.join(src_dir, f"{prefix}_manifest.json")) as f:
        manifest = json.load(f)
    chunks = []
    for part in manifest["parts"]:
        with open(os.path.join(src_dir, part), "rb") as f:
            chunks.append(f.read())
    data = b"".join(chunks)
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{src_dir}: the parts do not match embedded_manifest.json's sha256")
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            top = m.name.split("/")[0]
            if not m.isfile() or top not in ("target", "eagle3") or ".." in m.name.split("/"):
                raise ValueError(f"unexpected archive member {m.name!r}")
            parts = m.name.split("/")
            if prefix != "embedded":  # the head alone: its files go straight into dest
                parts = parts[1:]
            path = os.path.join(tmp, *parts)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(tar.extractfile(m).read())  # type: ignore[union-attr]
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    print(
        f"installed {len(manifest['files'])} files ({manifest['model_bytes'] / 1e6:.1f} MB) in {dest}"
    )
    return dest


def copy_results(family_dir: str, out_dir: str, methods: list[str]) -> None:
    """summary.json and the loss curves (target, and this call's drafters) into out_dir.

    NOTE: only this call's drafters: $OUT brings back at most 8 files."""
    shutil.copy(os.path.join(family_dir, "summary.json"), out_dir)
    png = os.path.join(family_dir, "target_loss.png")
    if os.path.isfile(png):
        shutil.copy(png, os.path.join(out_dir, "target_loss.png"))
    for m in methods:
        png = os.path.join(family_dir, "drafters", m, "loss_curve.png")
        if os.path.isfile(png):
            shutil.copy(png, os.path.join(out_dir, f"{m}_loss.png"))


def main(argv: list[str] | None = None) -> int:
    from specserve.train.family import (
        FAMILIES,
        STAGES,
        available_methods,
        build_family,
        format_table,
        with_overrides,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES) + ["smollm2"])
    p.add_argument("--gguf", help="smollm2: the target's GGUF file (default: the packaged one)")
    p.add_argument("--num-prompts", type=int, help="smollm2: distill this many prompts (smoke)")
    p.add_argument("--cache", help="family directory (default /tmp/family-<family>)")
    p.add_argument("--out-dir", default=os.environ.get("OUT"), help="results (default $OUT)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--methods", help="drafter methods (default: eagle3 for embedded, all for gpu)")
    p.add_argument("--minutes", type=float, help="wall-clock cap on the target's training")
    p.add_argument("--steps", type=int, help="target training steps (default: the preset's)")
    p.add_argument("--drafter-steps", type=int, help="steps of every drafter (smoke runs)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--install", metavar="DIR", help="unpack embedded parts from DIR (no build)")
    args = p.parse_args(argv)
    if args.install:
        install(args.install, prefix="smollm2_eagle3" if args.family == "smollm2" else "embedded")
        return 0
    if args.family is None:
        p.error("--family is required (or --install DIR)")
    if args.family == "smollm2":
        from build_smollm2 import build_smollm2

        return build_smollm2(args, pack)
    spec = with_overrides(
        FAMILIES[args.family], args.device, args.minutes, args.steps, args.drafter_steps
    )
    if args.no_compile:
        spec = replace(spec, train=replace(spec.train, compile=False))
    if args.methods:
        methods = args.methods.split(",")
    elif args.family == "embedded":
        methods = ["eagle3"]  # the one the package ships; the rest fit a second call
    else:
        methods = [m for m in spec.drafters if m in available_methods()]
    cache = args.cache or f"/tmp/family-{args.family}"
    stages = tuple(s for s in args.stages.split(",") if s)
    summary = build_family(spec, cache, args.device, stages, methods, progress=False)
    out_dir = args.out_dir or os.path.join(cache, "out")
    os.makedirs(out_dir, exist_ok=True)
    shipped = os.path.join(cache, "drafters", "eagle3", "model.safetensors")
    if args.family == "embedded" and "eagle3" in methods and os.path.isfile(shipped):
        summary["package"] = pack(cache, out_dir)
        with open(os.path.join(cache, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    copy_results(cache, out_dir, methods if "drafters" in stages else [])
    print(f"results in {out_dir}: {sorted(os.listdir(out_dir))}")
    if "package" in summary:
        print(f"embedded package: {summary['package']['model_bytes'] / 1e6:.1f} MB")
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
