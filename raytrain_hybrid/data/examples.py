"""The run's examples read in this process, step by step, without Ray (the engine's gloo
tests, a single-GPU run): chat or prompt/completion examples (data.format) from data.path, or
the shipped corpus's documents packed (data.packing). The rows come through the same stream as
under Ray (data.stream, data.sources), read from data.local_rows instead of Ray Data.
"""

from __future__ import annotations

from raytrain_hybrid.data.corpus import tokenize_corpus
from raytrain_hybrid.data.local_rows import documents, train_rows
from raytrain_hybrid.data.packing import corpus_documents
from raytrain_hybrid.data.rows import to_batch
from raytrain_hybrid.data.sources import TokenDocuments
from raytrain_hybrid.data.stream import ReplicaStream, replica_stream, stream_args
from raytrain_hybrid.data.tokenizer import EOT, load_tokenizer


def in_memory_examples(cfg, dp: int, dp_rank: int):
    """step -> this replica's batch (or None when data.epochs ran out), without Ray; raw text
    packed (data.packing): the shipped corpus's documents."""
    if cfg.data.format == "text":
        return in_memory_packed_text(cfg, dp, dp_rank)
    return stepper(replica_stream(cfg, train_rows(cfg), dp=dp, dp_rank=dp_rank))


def in_memory_packed_text(cfg, dp: int, dp_rank: int):
    """step -> this replica's batch (None when data.epochs ran out): the shipped corpus's
    documents, shuffled (data.shuffle_buffer, data.shuffle_seed) and packed, without Ray."""
    eot = load_tokenizer(cfg.data.tokenizer).token_to_id(EOT)
    docs = corpus_documents(tokenize_corpus(tokenizer=cfg.data.tokenizer), eot)
    m = cfg.model
    source = TokenDocuments(documents(docs), "input_ids", m.seq_len, m.vocab_size, packing=True)
    return stepper(ReplicaStream(source, **stream_args(cfg, dp, dp_rank)))


def stepper(stream):
    """A stream of per-step arrays as ``step -> Batch`` (None once it ends), read in step order."""
    steps = iter(stream)
    done = 0

    def next_batch(step: int):
        nonlocal done
        arrays = None
        while done <= step:  # a resumed run asks for its first step first
            arrays, done = next(steps, None), done + 1
        return None if arrays is None else to_batch(arrays)

    return next_batch
