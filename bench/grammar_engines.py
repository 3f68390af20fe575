"""Grammar engines side by side: llguidance and xgrammar.

Measures, for each engine and each tokenizer (the demo model's 1,024-token
BPE and a Qwen-sized ~150k-token byte-level BPE trained here on local text):

* tokenizer conversion time (what the engine side builds once per model);
* grammar compile time per schema (cold: no compiler cache);
* the batched mask fill at batch 32: one call per step filling 32 rows of the
  packed int32 bitmask, along real token paths (each row is fed the tokens of
  a valid document for its schema, so every mask is one a decode would need);
  per step and per token, with 1 and N threads;
* JSON Schema coverage: each feature is probed with a document that satisfies
  the schema and one that breaks only that feature; "yes" means compiled,
  accepted the first and rejected the second; "refused" means a compile error
  (the engine says it cannot); "ignored" means it compiled but let the
  invalid document through (the silent ignore we must not ship);
* install size: the wheel's own files and its dependency closure, from the
  installed distributions' RECORD files.

Run with the project's venv after `pip install llguidance xgrammar`:

    .venv/bin/python bench/grammar_engines.py [--steps 200] [--threads 1,2] [--out FILE.json]

The large tokenizer is trained once (~1 minute on 2 cores) and cached under
``--cache`` (default /tmp/mlx-trio-bench-tokenizer).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import re
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
DEMO = HERE.parent / "demo_model" / "mlx-trio-demo"

# ------------------------------------------------------------------ tokenizers

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _corpus_files(limit_bytes: int) -> list[str]:
    """Local text to train on: the venv's Python sources and docs, in a fixed order."""
    import site

    roots = [pathlib.Path(p) for p in site.getsitepackages()] + [pathlib.Path(os.__file__).parent]
    files, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".pyi", ".md", ".rst", ".txt", ".json") and path.is_file():
                size = path.stat().st_size
                if size < 2_000_000:
                    files.append(str(path))
                    total += size
            if total >= limit_bytes:
                return files
    return files


def large_tokenizer(cache: pathlib.Path, vocab_size: int = 151_643):
    """A Qwen-like tokenizer: Qwen2's split regex, byte-level BPE, ~150k tokens, Qwen specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = cache / "tokenizer.json"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(
                pattern=__import__("tokenizers").Regex(QWEN_SPLIT), behavior="isolated"
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=1,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        started = time.perf_counter()
        tok.train(_corpus_files(90_000_000), trainer)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
        tok.save(str(path))
        print(f"trained the large tokenizer in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
    return hf


def demo_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(DEMO / "tokenizer.json"), eos_token="<|im_end|>"
    )


# ---------------------------------------------------------------- workload

# (schema, a valid document) pairs: the decode paths the mask loop follows.
WORKLOAD = [
    (
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
         "additionalProperties": False},
        {"city": "Lisbon"},
    ),
    (
        {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
         "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                        "age": {"type": "integer", "minimum": 0, "maximum": 150},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]},
    ),
    (
        {"type": "object", "additionalProperties": False, "required": ["unit", "reading"],
         "properties": {"unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
                        "reading": {"type": "number", "minimum": -100, "maximum": 100}}},
        {"unit": "celsius", "reading": 21.5},
    ),
    (
        {"type": "object", "additionalProperties": False, "required": ["id", "when"],
         "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "when": {"type": "string", "format": "date"}}},
        {"id": "ABC-1234", "when": "2024-05-17"},
    ),
    (
        {"$defs": {"item": {"type": "object", "additionalProperties": False,
                            "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string"},
                                           "qty": {"type": "integer", "minimum": 1}}}},
         "type": "object", "additionalProperties": False, "required": ["order", "items"],
         "properties": {"order": {"type": "integer"},
                        "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                  "minItems": 1, "maxItems": 4}}},
        {"order": 1042, "items": [{"sku": "pen-blue", "qty": 3}, {"sku": "ink", "qty": 1}]},
    ),
    (
        {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": "get_weather"},
                            "arguments": {"type": "object", "additionalProperties": False,
                                          "required": ["city"],
                                          "properties": {"city": {"type": "string"}}}}},
            {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": "get_time"},
                            "arguments": {"type": "object", "additionalProperties": False,
                                          "required": ["timezone"],
                                          "properties": {"timezone": {"type": "string"}}}}},
        ]},
        {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}},
    ),
]

# (feature, schema, valid document, document invalid only through that feature)
COVERAGE = [
    ("nested objects", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]},
     {"a": {"b": 1}}, {"a": {"b": "x"}}),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}, {"a": 1, "b": 2}, {"a": 1}),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, {"a": 1}, {"a": 1, "z": 2}),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"x": 1}, {"x": "y"}),
    ("array items", {"type": "array", "items": {"type": "integer"}}, [1, 2], [1, "a"]),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2], [1, 2, 3]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], [1, 2]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [1, 2], [1, 1]),
    ("enum", {"enum": ["red", "green", 3]}, "green", "blue"),
    ("const", {"const": "fixed"}, "fixed", "other"),
    ("integer minimum/maximum", {"type": "integer", "minimum": 3, "maximum": 12}, 12, 13),
    ("number minimum/maximum", {"type": "number", "minimum": 0.5, "maximum": 2.5}, 2.25, 2.75),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    ("multipleOf (integer)", {"type": "integer", "multipleOf": 5}, 15, 16),
    ("multipleOf (decimal)", {"type": "number", "multipleOf": 0.25}, 0.5, 0.3),
    ("string minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    ("string pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12", "ab-123"),
    ("format: date-time", {"type": "string", "format": "date-time"},
     "2024-05-17T10:20:30Z", "yesterday"),
    ("format: date", {"type": "string", "format": "date"}, "2024-05-17", "17/05/2024"),
    ("format: email", {"type": "string", "format": "email"}, "ada@example.com", "ada.example.com"),
    ("format: uuid", {"type": "string", "format": "uuid"},
     "123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abc"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     {"a": 1, "b": 2}, {"a": 1}),
    ("$ref / $defs", {"$defs": {"p": {"type": "integer", "maximum": 5}}, "type": "object",
                      "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]},
     {"a": 5}, {"a": 6}),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     {"v": 1, "next": {"v": 2, "next": None}}, {"v": 1, "next": {"v": "x", "next": None}}),
    ("type list", {"type": ["integer", "null"]}, None, "x"),
    ("minProperties", {"type": "object", "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1}),
    ("maxProperties", {"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"n_a": "x"}),
    ("if/then/else", {"type": "object", "if": {"properties": {"k": {"const": 1}}},
                      "then": {"required": ["v"]}}, {"k": 1, "v": 2}, {"k": 1}),
    ("not", {"not": {"type": "string"}}, 1, "x"),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}},
     {"a": 1, "b": 2}, {"a": 1}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, ["a", 1], ["a"]),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a"}}, {"ab": 1}, {"b": 1}),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                               "unevaluatedProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
]


def _doc(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


# ------------------------------------------------------------------- engines


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self._llg = llguidance
        self._np = llguidance.numpy
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=hf.eos_token_id)
        self.tokenizer_s = time.perf_counter() - started
        self.vocab_size = self.tokenizer.vocab_size
        self.eos = hf.eos_token_id
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema):
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        return self._llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def bitmask(self, rows):
        return self._np.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask):
        self._np.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def consume(self, matcher, token) -> bool:
        return matcher.consume_token(token)

    def accepts(self, compiled, text: str) -> bool:
        matcher = self.matcher(compiled)
        tokens = self.tokenizer.tokenize_str(text)
        return matcher.consume_tokens(tokens) and matcher.consume_token(self.eos)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, threads: int):
        import xgrammar

        self._xgr = xgrammar
        started = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, stop_token_ids=[hf.eos_token_id])
        self.tokenizer_s = time.perf_counter() - started
        self.vocab_size = self.info.vocab_size
        self.eos = hf.eos_token_id
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema):
        # JSON Schema semantics (undeclared properties allowed unless the schema says no),
        # the same as llguidance's default.
        return self.compiler.compile_json_schema(schema, strict_mode=False)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self, rows):
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher, token) -> bool:
        return matcher.accept_token(token)

    def accepts(self, compiled, text: str) -> bool:
        matcher = self.matcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(self.eos)


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


# ------------------------------------------------------------ measurements


def compile_times(engine, repeats: int = 3) -> list[float]:
    """Per workload schema, the best of ``repeats`` cold compiles, in ms."""
    out = []
    for schema, _ in WORKLOAD:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            engine.compile(schema)
            best = min(best, time.perf_counter() - started)
        out.append(best * 1e3)
    return out


def mask_loop(engine, hf, batch: int, steps: int) -> dict:
    """Teacher-forced decode of ``batch`` rows; each step fills all rows in one call."""
    compiled = [engine.compile(schema) for schema, _ in WORKLOAD]
    paths = [hf.encode(_doc(doc), add_special_tokens=False) + [engine.eos] for _, doc in WORKLOAD]
    rows = []  # [workload index, matcher, position]
    for i in range(batch):
        w = i % len(WORKLOAD)
        rows.append([w, engine.matcher(compiled[w]), (i * 3) % len(paths[w])])
        for token in paths[w][: rows[-1][2]]:  # stagger the rows along their documents
            engine.consume(rows[-1][1], token)
    bitmask = engine.bitmask(batch)
    array = bitmask.numpy() if hasattr(bitmask, "numpy") else bitmask
    fill_s, fill_cpu_s, consume_s, refused = [], 0.0, 0.0, 0
    for _ in range(steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        engine.fill([r[1] for r in rows], bitmask)
        fill_s.append(time.perf_counter() - started)
        fill_cpu_s += time.process_time() - started_cpu
        started = time.perf_counter()
        for i, row in enumerate(rows):
            w, matcher, pos = row
            token = paths[w][pos]
            if not (array[i, token // 32] >> (token % 32)) & 1:
                refused += 1  # the engine's mask forbids the valid document's next token
            engine.consume(matcher, token)
            row[2] += 1
        consume_s += time.perf_counter() - started
        for row in rows:
            if row[2] == len(paths[row[0]]):
                row[1], row[2] = engine.matcher(compiled[row[0]]), 0
    ms = sorted(s * 1e3 for s in fill_s)
    return {
        "fill_ms_mean": statistics.fmean(ms),
        "fill_ms_p50": ms[len(ms) // 2],
        "fill_ms_p95": ms[int(len(ms) * 0.95)],
        "fill_us_per_token": statistics.fmean(ms) * 1e3 / batch,
        # CPU seconds of all the process's threads: the work, whatever the neighbours do
        "fill_cpu_ms_per_step": fill_cpu_s * 1e3 / steps,
        "consume_us_per_token": consume_s * 1e6 / (steps * batch),
        "valid_tokens_refused": refused,
    }


def matcher_build_ms(engine, repeats: int = 5) -> float:
    compiled = [engine.compile(schema) for schema, _ in WORKLOAD]
    started = time.perf_counter()
    for _ in range(repeats):
        for c in compiled:
            engine.matcher(c)
    return (time.perf_counter() - started) * 1e3 / (repeats * len(compiled))


def coverage(engine) -> dict[str, str]:
    out = {}
    for feature, schema, valid, invalid in COVERAGE:
        try:
            compiled = engine.compile(schema)
        except Exception as exc:  # the engine refuses the schema: explicit, not silent
            out[feature] = "refused: " + re.sub(r"\s+", " ", str(exc))[:80]
            continue
        ok = engine.accepts(compiled, _doc(valid))
        strict = not engine.accepts(compiled, _doc(invalid))
        out[feature] = "yes" if ok and strict else ("ignored" if ok else "rejects valid")
    return out


def install_size(dist_name: str) -> dict:
    """The distribution's own bytes and those of its runtime dependency closure."""
    seen: dict[str, int] = {}

    def visit(name: str):
        key = name.lower().replace("_", "-")
        if key in seen:
            return
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return
        total = 0
        for f in dist.files or ():
            try:
                total += f.locate().stat().st_size
            except OSError:
                pass
        seen[key] = total
        for req in dist.requires or ():
            if "extra ==" in req:
                continue
            if ";" in req and "sys_platform" in req and "linux" not in req:
                continue
            visit(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])

    visit(dist_name)
    base: set[str] = set()
    try:
        server_requires = importlib.metadata.distribution("mlx-trio-server").requires or ()
    except importlib.metadata.PackageNotFoundError:
        server_requires = ()
    for req in server_requires:
        if "extra ==" not in req:
            _closure(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0], base)
    own = seen.get(dist_name.lower())
    extra = {k: v for k, v in seen.items() if k not in base}
    return {
        "own_mb": own / 1e6,
        "closure_mb": sum(seen.values()) / 1e6,
        "added_to_server_mb": sum(extra.values()) / 1e6,
        "added_packages": sorted(extra, key=lambda k: -extra[k]),
    }


def _closure(name: str, out: set[str]) -> None:
    key = name.lower().replace("_", "-")
    if key in out:
        return
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return
    out.add(key)
    for req in dist.requires or ():
        if "extra ==" not in req:
            _closure(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0], out)


def import_seconds(module: str) -> float:
    import subprocess

    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", default=f"1,{os.cpu_count()}")
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--cache", type=pathlib.Path,
                        default=pathlib.Path("/tmp/mlx-trio-bench-tokenizer"))
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    tokenizers = {"demo (1,024)": demo_tokenizer()}
    if not args.skip_large:
        hf = large_tokenizer(args.cache)
        tokenizers[f"qwen-like ({len(hf):,})"] = hf
    threads = [int(t) for t in args.threads.split(",")]
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                     "engines": {}}
    for name in args.engines.split(","):
        entry = results["engines"].setdefault(name, {})
        entry["version"] = importlib.metadata.version(name)
        entry["import_s"] = import_seconds(name)
        entry["install"] = install_size(name)
        for tok_name, hf in tokenizers.items():
            per_tok = entry.setdefault(tok_name, {})
            engine = ENGINES[name](hf, threads[0])
            per_tok["tokenizer_build_s"] = engine.tokenizer_s
            per_tok["compile_ms"] = compile_times(engine)
            per_tok["matcher_build_ms"] = matcher_build_ms(engine)
            for n in threads:
                engine = ENGINES[name](hf, n)
                per_tok[f"batch{args.batch}_threads{n}"] = mask_loop(engine, hf, args.batch, args.steps)
            if tok_name.startswith("demo"):
                entry["coverage"] = coverage(engine)
            print(f"{name} / {tok_name}: {json.dumps(per_tok)}", file=sys.stderr)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
