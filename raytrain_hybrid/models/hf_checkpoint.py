"""Hugging Face language-model checkpoints (``model.pretrained``): where they are, which
architecture and sizes they fix, and where each engine parameter's values lie in them.

A checkpoint is a directory (local, or an object-store URI) with ``config.json`` and
safetensors weights, one ``model.safetensors`` or ``model-0000x-of-0000y.safetensors``
shards, or a Hugging Face Hub id (``org/name``, ``models.hub``) naming such a repository.
This module reads only ``config.json`` and directory listings; the weights are read slice by
slice into each rank's shards by ``checkpoint.hf_load``.

It sits below the storage layer (config resolution reads ``config.json`` before any storage
object exists), so a URI is opened with ``pyarrow.fs`` itself, the library
``raytrain_hybrid.storage`` wraps: endpoint and credentials come from the same environment.
Its waits are bounded (a few seconds, two tries): ``check`` on a laptop without a network or
credentials says what it could not read instead of retrying for minutes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from raytrain_hybrid.errors import ConfigError, storage_reason
from raytrain_hybrid.models import hub
from raytrain_hybrid.models.hub import Unreadable, is_hub_id

KEY = "model.pretrained"
SAFETENSORS = ".safetensors"
# train.lr = 0 picks this when fine-tuning a checkpoint (TRL's SFTConfig default).
FINETUNE_LR = 2e-5


def is_set(pretrained: str) -> bool:
    """``model.pretrained`` names a checkpoint ("" and "none": random weights, for the LMs)."""
    return bool(pretrained) and pretrained.lower() != "none"


def _is_uri(location: str) -> bool:
    return "://" in location


def _filesystem(location: str):
    """pyarrow's filesystem and path for a URI, with bounded waits: S3 tries twice with a 5 s
    connect timeout (the SDK's defaults retry a dead endpoint for a long time), GCS retries for
    10 s (its default: 15 minutes). A region from the environment spares S3 the bucket's
    region look-up (one more round of retries)."""
    import pyarrow.fs as pafs

    parts = urlsplit(location)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if parts.scheme == "s3" and region and "region=" not in parts.query:
        location = parts._replace(query="&".join(q for q in (parts.query, f"region={region}") if q)).geturl()
    try:
        fs, path = pafs.FileSystem.from_uri(location)
    except OSError as exc:  # e.g. the bucket's region look-up: no network
        raise Unreadable(KEY, location, f"could not be read here: {storage_reason(exc)}") from None
    except ValueError as exc:  # pyarrow.ArrowInvalid: a scheme it does not know
        raise ConfigError(
            KEY,
            location,
            f"is not a location pyarrow can open ({storage_reason(exc)}); use a local path, s3:// or gs://",
        ) from None
    return bounded_waits(fs), path.rstrip("/")


def bounded_waits(fs, request_s: float = 30):
    """``fs`` with its options kept and bounded waits: an S3 filesystem with a 5 s connect timeout,
    ``request_s`` a request and two tries; a GCS one retrying for 10 s; any other as it is."""
    import pyarrow.fs as pafs

    if not isinstance(fs, (pafs.S3FileSystem, pafs.GcsFileSystem)):
        return fs
    rebuild, (options,) = fs.__reduce__()
    if isinstance(fs, pafs.S3FileSystem):
        options.update(connect_timeout=5, request_timeout=request_s)
        options["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=2)
    else:
        options["retry_time_limit"] = datetime.timedelta(seconds=10)
    return rebuild(options)


def _listing(location: str) -> tuple[list[str], Callable[[str], bytes]]:
    """The file names in ``location`` and a reader of one of them (name -> bytes); a location
    that cannot be read here (no network, no credentials) raises ``Unreadable``."""
    if _is_uri(location):
        import pyarrow.fs as pafs

        fs, root = _filesystem(location)
        try:
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=False))
        except FileNotFoundError:
            infos = []
        except OSError as exc:  # no credentials, access denied, no network
            raise Unreadable(KEY, location, f"could not be read here: {storage_reason(exc)}") from None
        names = [i.base_name for i in infos if i.type == pafs.FileType.File]

        def read(name: str) -> bytes:
            with fs.open_input_stream(f"{root}/{name}") as f:
                return f.read()

        return names, read
    path = Path(location).expanduser()
    names = [p.name for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return names, lambda name: (path / name).read_bytes()


def read_config_json(location: str, revision: str = "") -> dict:
    """The checkpoint's config.json (all that resolving and checking a config needs: ``check``
    and the planner work from it alone); refuses a directory without one. ``revision``: a Hub
    id's branch, tag or commit (model.pretrained_revision)."""
    if is_hub_id(location):
        return hub.config_json(location, revision)[0]
    names, read = _listing(location)
    # An adapter directory, with or without the base model's config.json beside it (some trainers
    # write one there): no weights of a model, only adapter_model.safetensors.
    if "adapter_config.json" in names and not any(
        n.endswith(SAFETENSORS) and not n.startswith("adapter_model") for n in names
    ):
        raise ConfigError(KEY, location, hub.adapter_fix(read("adapter_config.json")))
    if "config.json" not in names:
        raise ConfigError(
            KEY,
            location,
            "has no config.json; give a Hugging Face model directory (config.json + *.safetensors), "
            "local or a storage URI, or none for random weights",
        )
    try:
        conf = json.loads(read("config.json"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(KEY, location, f"has a config.json that is not JSON ({exc})") from None
    if not isinstance(conf, dict):
        raise ConfigError(KEY, location, f"has a config.json that is not a JSON object (a {type(conf).__name__})")
    return hub.refuse_quantized(conf, location)


def check_weights(location: str, revision: str = "") -> None:
    """Refuse a checkpoint without safetensors weights (before any worker starts, and on load;
    a Hub id's before the workers start only when the Hub can be asked)."""
    if is_hub_id(location):
        names = hub.weight_files(location, revision)
        if names is None:
            return
    else:
        names, _ = _listing(location)
    if not any(n.endswith(SAFETENSORS) for n in names):
        other = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (it has {other[0]}: save it with save_pretrained(dir, safe_serialization=True))" if other else ""
        raise ConfigError(KEY, location, f"has no *.safetensors weights next to config.json{hint}")
    if not is_hub_id(location) and (found := quantized_tensor(location)):
        raise ConfigError(
            KEY,
            location,
            f"stores {found[0]} as {found[1]}, a quantized type, although its config.json has no "
            "quantization_config; give the model's unquantized checkpoint (bf16, fp16 or fp32 safetensors)",
        )


# Tensor types of a safetensors header that no unquantized model's weights have: 8-, 6- and 4-bit
# floats (FP8 blocks, MXFP4), and integers where a weight is stored (GPTQ/AWQ packing, bitsandbytes).
_QUANTIZED_FLOAT = re.compile(r"F8_\w+|F6_\w+|F4")  # (F8_E4M3, F8_E5M2, F8_E8M0, F6_E2M3, F6_E3M2, F4)
_INTEGER = ("I4", "U4", "I8", "U8", "I16", "U16", "I32", "U32")


def quantized_tensor(location: str) -> tuple[str, str] | None:
    """(name, type) of the first tensor its headers store as a quantized type: a float of 8 bits or
    fewer, or a weight stored as integers; None where none is (or the headers cannot be read: the
    workers' reader then says what is wrong with a file)."""
    for name, info in (_headers(location) or {}).items():
        dtype = str(info.get("dtype", "")) if isinstance(info, dict) else ""
        if _QUANTIZED_FLOAT.fullmatch(dtype) or (dtype in _INTEGER and name.endswith(("weight", "qweight"))):
            return name, dtype
    return None


def tensor_sizes(location: str) -> dict[str, int] | None:
    """{tensor name: elements} of a checkpoint's safetensors files, from their headers alone (a few
    KB each, by byte range on object storage; no torch); None where they cannot be read so (a Hub
    id, a header that is not one): the caller counts another way."""
    import math

    headers = _headers(location)
    if not headers:
        return None
    sizes: dict[str, int] = {}
    for name, info in headers.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return None
        sizes[name] = math.prod(shape)
    return sizes


def _headers(location: str) -> dict[str, dict] | None:
    """{tensor name: its header entry (dtype, shape, offsets)} of a checkpoint's safetensors files
    (a few KB each, by byte range on object storage; no torch); None where they cannot be read so."""
    if is_hub_id(location):
        return None
    try:
        if _is_uri(location):
            fs, root = _filesystem(location)
            names, _ = _listing(location)
            opened = [fs.open_input_file(f"{root}/{n}") for n in sorted(names) if n.endswith(SAFETENSORS)]
        else:
            import pyarrow as pa

            names, _ = _listing(location)
            folder = Path(location).expanduser()
            opened = [pa.OSFile(str(folder / n)) for n in sorted(names) if n.endswith(SAFETENSORS)]
        found: dict[str, dict] = {}
        for f in opened:
            with f:
                length = int.from_bytes(f.read_at(8, 0), "little")
                if not 2 <= length <= min(f.size() - 8, 100 << 20):
                    return None
                header = json.loads(f.read_at(length, 8))
            if not isinstance(header, dict):
                return None
            found |= {name: info for name, info in header.items() if name != "__metadata__"}
        return found or None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError, Unreadable):
        return None  # (the workers' reader says what is wrong with a file, naming it)


def local_dir(location: str) -> Path:
    """A local checkpoint's directory, made absolute (a URI is read by range where it is)."""
    return Path(location).expanduser().resolve()


def arch_of(model_type: str, location: str) -> str:
    """The registry's architecture for the ``model_type`` of the checkpoint at ``location``."""
    from raytrain_hybrid.models import hand_arch_of

    # By name: asking every spec would import GPT-2's, and with it torch and transformers.
    name = hand_arch_of(model_type)
    if name is not None:
        return name
    if model_type == "bert":
        raise ConfigError(
            KEY, location, "is a BERT checkpoint, which is for the classifier: model.arch=multimodal-bert"
        )
    from raytrain_hybrid.models import generic

    try:
        why = generic.refusal(model_type)
    except Exception:  # noqa: BLE001 - a model_type transformers does not know
        why = "is not a model_type transformers knows"
    if why:
        raise ConfigError(
            KEY,
            location,
            f"model_type {model_type!r} {why}; supported: transformers decoder families with tensor and "
            "pipeline plans (docs/models.md)",
        )
    return model_type


def resolve(model, given: set[str] | None = None, unverified: list[str] | None = None):
    """``model`` (a ModelConfig) with the architecture and sizes of its checkpoint; a key the
    user named (``given``; None: a key set to something else than its default) must agree with
    the checkpoint's value: `model.num_layers=4` is refused for a 32-layer checkpoint although
    4 is the default. A Hub id's revision is pinned to the commit its config.json came from.
    ``unverified`` (``check``): a config.json that cannot be read here is noted there and the
    model kept as given, instead of refused."""
    from raytrain_hybrid.models import get_arch

    revision, on_hub = model.pretrained_revision, is_hub_id(model.pretrained)
    if revision and not on_hub:
        raise ConfigError(
            hub.REVISION_KEY,
            revision,
            f"pins a Hugging Face Hub repository, and model.pretrained={model.pretrained!r} is not a Hub id "
            "(org/name); drop it, or name the repository",
        )
    if not is_set(model.pretrained) or get_arch(model.arch).task != "lm":
        return model
    try:
        if on_hub:
            conf, commit = hub.config_json(model.pretrained, revision, quick=unverified is not None)
        else:
            conf, commit = read_config_json(model.pretrained), ""
    except Unreadable as exc:
        if unverified is None:
            raise
        unverified.append(
            f"{KEY}={model.pretrained!r} {exc.fix}; the architecture and sizes its config.json fixes are not "
            "checked (the model keys are checked as the config file gives them)"
        )
        return model
    arch = arch_of(conf.get("model_type", "?"), model.pretrained)
    spec = get_arch(arch)
    # A local path made absolute: workers (Ray's, elsewhere) do not run in this directory.
    where = model.pretrained if _is_uri(model.pretrained) or on_hub else str(local_dir(model.pretrained))
    try:
        want = {"arch": arch, **spec.sizes_from_hf(conf)}
        limit = spec.max_seq_len(conf)
        if limit is not None and type(limit) is not int:
            raise TypeError(f"its context length is {limit!r}")
        defaults = type(model)()
        for key, value in want.items():  # a size of another type (a string, a float) fails as one
            if type(value) is not type(getattr(defaults, key)) or (isinstance(value, int) and value < 0):
                raise TypeError(f"{key} is {value!r}")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' strict config classes raise their own errors
        # A config.json missing a key the architecture reads, holding a value of another type, or one
        # the family's config class refuses.
        raise ConfigError(
            KEY,
            model.pretrained,
            f"has a config.json that does not describe a {arch} model ({type(exc).__name__}: {exc}); "
            "give a checkpoint transformers itself wrote",
        ) from None
    defaults = type(model)()
    for key, value in want.items():
        mine = getattr(model, key)
        named = key in given if given is not None else mine != getattr(defaults, key)
        if named and mine != value:
            raise ConfigError(
                f"model.{key}",
                mine,
                f"disagrees with the checkpoint {model.pretrained}, whose value is {value!r}; "
                f"drop model.{key} (the checkpoint's config.json sets it) or set it to {value!r}",
            )
    if limit and model.seq_len > limit:
        raise ConfigError(
            "model.seq_len", model.seq_len, f"exceeds what the checkpoint {model.pretrained} attends over ({limit})"
        )
    return dataclasses.replace(model, pretrained=where, pretrained_revision=commit or revision, **want)


def checkpoint_config(config_cls, model, **overrides):
    """The transformers config of ``model``'s checkpoint (a ModelConfig's pretrained and
    pretrained_revision), RoPE scaling and every other setting kept, with the engine's
    overrides (untied head: embedding and head live on different stages)."""
    # The engine holds fp32 master weights: the checkpoint's storage dtype is not the model's.
    dropped = ("architectures", "transformers_version", "torch_dtype", "dtype")
    conf = {k: v for k, v in read_config_json(model.pretrained, model.pretrained_revision).items() if k not in dropped}
    conf.update(tie_word_embeddings=False, use_cache=False, **overrides)
    return config_cls(**conf, attn_implementation="sdpa")
