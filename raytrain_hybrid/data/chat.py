"""Chat and prompt/completion rows -> token ids and a label mask (``data.format``).

One row is one example: its tokens (at most ``model.seq_len + 1``) and a 0/1 mask saying
which of them the loss counts (assistant turns, or the completion). A ``chat`` row is
rendered with the tokenizer's chat template. Templates that mark assistant text with
``{% generation %}`` give the mask through transformers (``return_assistant_tokens_mask``);
for the others (most published ones: Llama 3, Qwen2, Mistral) each assistant turn is found by
rendering the conversation up to it twice, with the generation prompt (where the turn starts)
and with the turn (where it ends), as TRL does; the whole conversation is tokenized once and
every token whose text starts inside a turn counts. So the turn's closing token (``<|eot_id|>``,
``<|im_end|>``) is learnt and the header that opens it is not. A ``prompt_completion`` row is
the prompt and completion tokenized as one text, the completion's tokens counted, the
tokenizer's end-of-sequence token appended (and counted) when it has one.

An example longer than the window is cut at its end (CUT); one with no counted token left in
the window's labels (positions 1..seq_len: token 0 is never predicted) is LONG_PROMPT. Both
are counted by the input check before workers start (data.checks), which refuses LONG_PROMPT
rows unless ``data.drop_long_prompts``, and the rows that are wrong in themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from raytrain_hybrid.data.tokenizer import TokenizerFiles, load_hf_tokenizer

# What a row became.
OK, CUT, LONG_PROMPT = "ok", "cut", "long_prompt"
ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RowError(ValueError):
    """A row that cannot be trained on as it is: ``key`` is the config key naming its column."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class ExampleSpec:
    """Everything a Ray Data task needs to encode rows (picklable: the tokenizer as its files)."""

    format: str
    columns: tuple[str, ...]  # chat: (messages,); prompt_completion: (prompt, completion)
    keys: tuple[str, ...]  # the config keys that name them
    seq_len: int
    tokenizer: TokenizerFiles

    @classmethod
    def of(cls, cfg, tokenizer: TokenizerFiles | None = None) -> ExampleSpec:
        from raytrain_hybrid.data.tokenizer import tokenizer_source

        d = cfg.data
        if d.format == "chat":
            columns, keys = (d.messages_column,), ("data.messages_column",)
        else:
            columns, keys = (d.prompt_column, d.completion_column), ("data.prompt_column", "data.completion_column")
        tokenizer = tokenizer or TokenizerFiles.read(tokenizer_source(cfg))
        return cls(d.format, columns, keys, cfg.model.seq_len, tokenizer)


def encode_row(tok, spec: ExampleSpec, values: tuple) -> tuple[list[int], list[int], str]:
    """One row's (ids, mask, status), cut to the window. Raises RowError for a bad row."""
    if spec.format == "chat":
        ids, mask = chat_tokens(tok, values[0], spec.keys[0])
    else:
        ids, mask = prompt_completion_tokens(tok, values, spec.keys)
    window = spec.seq_len + 1
    status = OK
    if len(ids) > window:
        ids, mask, status = ids[:window], mask[:window], CUT
    if not any(mask[1:]):
        status = LONG_PROMPT
    return ids, mask, status


def chat_tokens(tok, messages, key: str) -> tuple[list[int], list[int]]:
    messages = _checked_messages(messages, key)

    def render(msgs, **kw):
        try:
            return tok.apply_chat_template(msgs, **kw)
        except Exception as exc:  # the template's own raise_exception (e.g. roles must alternate)
            raise RowError(key, f"holds a conversation the chat template refuses: {exc}") from exc

    if _GENERATION.search(tok.chat_template or ""):
        out = render(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    full = render(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = render(messages[: i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise RowError(
                "data.format",
                "the chat template does not render a conversation turn by turn (an earlier part changes when "
                "a later turn is added), so the assistant turns cannot be found; use a template that marks "
                "them with {% generation %}",
            )
        spans.append((len(before), len(through)))
    # As apply_chat_template tokenizes: the template writes the special tokens itself.
    return _tokens_in_spans(tok, full, spans, special=False)


def prompt_completion_tokens(tok, values: tuple, keys: tuple[str, ...]) -> tuple[list[int], list[int]]:
    for value, key in zip(values, keys, strict=True):
        if not isinstance(value, str):
            raise RowError(key, f"holds {type(value).__name__} values; each row needs text")
    prompt, completion = values
    # With the tokenizer's own special tokens (a BOS), as TRL tokenizes a prompt.
    spans = [(len(prompt), len(prompt) + len(completion))]
    ids, mask = _tokens_in_spans(tok, prompt + completion, spans, special=True)
    if tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
        ids, mask = [*ids, int(tok.eos_token_id)], [*mask, 1]
    if not any(mask):
        raise RowError(keys[1], "holds an empty completion (and the tokenizer has no end-of-sequence token)")
    return ids, mask


def _tokens_in_spans(tok, text: str, spans: list[tuple[int, int]], special: bool) -> tuple[list[int], list[int]]:
    """``text`` tokenized once; a token counts when the text it covers starts inside one of
    ``spans`` (character offsets). ``special``: add the tokenizer's special tokens (a BOS)."""
    enc = tok(text, add_special_tokens=special, return_offsets_mapping=True)
    inside = np.zeros(len(text) + 1, dtype=bool)
    for a, b in spans:
        inside[a:b] = True
    mask = [int(b > a and inside[a]) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _checked_messages(messages, key: str) -> list[dict]:
    if not isinstance(messages, list | tuple | np.ndarray) or not len(messages):
        raise RowError(key, "holds a row that is not a list of messages [{role, content}]")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RowError(key, f"holds a message that is not {{role, content}}: {str(m)[:80]!r}")
        if m["role"] not in ROLES:
            raise RowError(key, f"holds a message with role {m['role']!r}; roles are {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"] if m["content"] is not None else ""})
    if not any(m["role"] == "assistant" for m in out):
        raise RowError(key, "holds a conversation with no assistant turn: nothing to train on; drop such rows")
    return out


def encode_table(batch: pa.Table, *, spec: ExampleSpec) -> pa.Table:
    """One Ray Data batch of rows -> ``input_ids``, ``label_mask`` (and ``path`` when the batch
    has it); LONG_PROMPT rows are left out (the input check refused them unless
    data.drop_long_prompts)."""
    tok = load_hf_tokenizer(spec.tokenizer)
    columns = [batch.column(c).to_pylist() for c in spec.columns]
    keep, ids, masks = [], [], []
    for i, values in enumerate(zip(*columns, strict=True)):
        row_ids, mask, status = encode_row(tok, spec, values)
        if status == LONG_PROMPT:
            continue
        keep.append(i)
        ids.append(row_ids)
        masks.append(mask)
    out = {
        "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
        "label_mask": pa.array(masks, type=pa.list_(pa.int8())),
    }
    if "path" in batch.column_names:
        out["path"] = batch.column("path").take(pa.array(keep, type=pa.int64()))
    return pa.table(out)


def row_outcomes(batch: pa.Table, *, spec: ExampleSpec) -> pa.Table:
    """What each row of ``batch`` becomes, for the input check (in this process, or in Ray
    Data's tasks for a large data set): ``status`` (OK, CUT, LONG_PROMPT or "error"),
    ``prompt`` (a LONG_PROMPT row's tokens before its first counted one), for an error the
    config ``key`` and ``message``, and ``tokens`` (the row's, cut to the window)."""
    tok = load_hf_tokenizer(spec.tokenizer)
    out: dict[str, list] = {"status": [], "prompt": [], "key": [], "message": [], "tokens": []}
    for values in zip(*(batch.column(c).to_pylist() for c in spec.columns), strict=True):
        prompt, key, message, tokens = 0, "", "", 0
        try:
            ids, _, status = encode_row(tok, spec, values)
            tokens = len(ids)
            if status == LONG_PROMPT:
                prompt = _prompt_length(tok, spec, values)
        except RowError as exc:
            status, key, message = "error", exc.key, str(exc)
        for name, value in zip(out, (status, prompt, key, message, tokens), strict=True):
            out[name].append(value)
    return pa.table(out)


def _prompt_length(tok, spec: ExampleSpec, values: tuple) -> int:
    """The tokens before the first counted one (to say how long the longest prompt is)."""
    if spec.format == "chat":
        _, mask = chat_tokens(tok, values[0], spec.keys[0])
    else:
        _, mask = prompt_completion_tokens(tok, values, spec.keys)
    return mask.index(1) if 1 in mask else len(mask)


@dataclass
class ExampleReport:
    """What the input check found over all rows of data.path, in their order."""

    rows: int = 0
    cut: int = 0
    long_prompts: int = 0
    first_long: int = -1  # row index of the first LONG_PROMPT row
    longest_prompt: int = 0  # tokens before the first counted token, over LONG_PROMPT rows
    lengths: list[int] = field(default_factory=list)  # tokens of each row that trains, in order

    def add(self, outcomes: pa.Table) -> None:
        """The next rows' outcomes (row_outcomes); the first bad row raises RowError, naming it."""
        columns = [outcomes.column(c).to_pylist() for c in ("status", "prompt", "key", "message", "tokens")]
        for status, prompt, key, message, tokens in zip(*columns, strict=True):
            index, self.rows = self.rows, self.rows + 1
            if status == "error":
                raise RowError(key, f"row {index}: {message}")
            self.cut += status == CUT
            if status != LONG_PROMPT:
                self.lengths.append(tokens)
            if status == LONG_PROMPT:
                self.long_prompts += 1
                self.first_long = index if self.first_long < 0 else self.first_long
                self.longest_prompt = max(self.longest_prompt, prompt)

    @property
    def trained(self) -> int:
        return self.rows - self.long_prompts
