"""Hugging Face Hub ids as ``model.pretrained`` (``"Qwen/Qwen2.5-0.5B"``): recognized, and
resolved with ``huggingface_hub`` into its cache.

The driver reads only the repository's ``config.json`` (``hf_hub_download``: resolving and
checking a config needs nothing else) and pins the commit it came from in
``model.pretrained_revision``, so every node loads the same files however the branch moves.
Each node's workers then fetch the whole snapshot (``snapshot_download``) into that node's
cache, once: the first rank downloads, the others find the files there. Tokenizer files come
with the snapshot; the driver fetches them without the weights when it needs the tokenizer.

Authentication, endpoint, cache location and offline mode are ``huggingface_hub``'s own
environment (``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE=1``): nothing here reads or passes a token, so none can be written to a
config, a manifest, a summary or an error. A gated or private repository needs HF_TOKEN where
the driver runs and on every node (the node's environment, or a Kubernetes secret: Ray does
not carry the driver's environment to other nodes). ``huggingface_hub`` is imported inside
functions only: loading a config imports it when a Hub id is named.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from raytrain_hybrid.errors import ConfigError

KEY = "model.pretrained"
REVISION_KEY = "model.pretrained_revision"
# A Hub repository id: namespace/name of letters, digits, "-", "_" and "." (the Hub's rule).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What a snapshot holds besides the tokenizer, config and generation files: the driver skips it.
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ckpt")


class Unreadable(ConfigError):
    """The checkpoint's config.json could not be read here (no network, no credentials, offline
    and not cached): it may well exist. ``check`` says so and goes on; a run stops."""


class NotAModel(ConfigError):
    """The repository (or its snapshot in the cache) has no config.json."""


def adapter_fix(adapter_config: bytes | None) -> str:
    """What to say of a PEFT adapter (its adapter_config.json's bytes) given as the model: its base
    model is the checkpoint (an adapter is trained anew with lora.*, or merged into its base first)."""
    try:
        base = json.loads(adapter_config or b"").get("base_model_name_or_path")
    except (ValueError, UnicodeDecodeError, AttributeError):
        base = None
    said = f"model.pretrained={base!r}" if isinstance(base, str) and base else "its base model"
    return (
        f"is a PEFT adapter (adapter_config.json), not a model; give {said} as the checkpoint and "
        "lora.* to train an adapter, or merge it into its base first (peft's merge_and_unload)"
    )


def refuse_quantized(conf: dict, location: str) -> dict:
    """``conf``, unless its checkpoint is quantized (FP8 with scales, AWQ, GPTQ, bitsandbytes,
    compressed-tensors: a ``quantization_config``). Its tensors are not the model's weights (int4
    packed in int32, FP8 beside their inverse scales) and the loader reads a tensor by its name:
    FP8 blocks would be cast without their scales into wrong weights, packed ones fail to fit."""
    # (a multimodal release may keep it in its language model's text_config)
    nested = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else {}
    quant = conf.get("quantization_config", nested.get("quantization_config"))
    if quant is None:
        return conf
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    fix = "give the model's unquantized checkpoint (its bf16 or fp32 safetensors"
    if method == "mxfp4":  # gpt-oss's releases: no unquantized one is published
        fix += ": load it with transformers' Mxfp4Config(dequantize=True) and save_pretrained it)"
    else:
        fix += ", often the same name without -FP8, -AWQ or -GPTQ)"
    raise ConfigError(
        KEY,
        location,
        f"is a quantized checkpoint (config.json's quantization_config: quant_method={method!r}), whose "
        f"tensors are not the model's weights; {fix}",
    )


def is_hub_id(location: str) -> bool:
    """``org/name`` with no scheme that is not a path on this machine (a local directory of
    that name wins: ``./org/name`` or an absolute path names a directory unambiguously). When the
    ``org`` part is a local directory (``runs/my-model`` before it was made), it is a path that
    does not exist yet, refused as such, not an id looked up on the Hub."""
    if "://" in location or not _REPO_ID.fullmatch(location):
        return False
    path = Path(location).expanduser()
    return not path.exists() and not path.parent.is_dir()


def config_json(repo: str, revision: str = "", quick: bool = False) -> tuple[dict, str]:
    """The repository's config.json and the commit it was read at (its snapshot folder's name).
    ``quick`` (``check``): the cached file if there is one, else one look at the Hub first: its
    download retries an unreachable Hub for half a minute or more before it gives up."""
    from huggingface_hub import constants, errors, get_hf_file_metadata, hf_hub_download, hf_hub_url

    path = None
    if quick and not constants.is_offline_mode():
        try:
            path = hf_hub_download(repo, "config.json", revision=revision or None, local_files_only=True)
        except errors.LocalEntryNotFoundError:
            url = hf_hub_url(repo, "config.json", revision=revision or None)
            _call(lambda repo_id, revision: get_hf_file_metadata(url, timeout=10), repo, revision)
    try:
        if path is None:
            path = _call(hf_hub_download, repo, revision, filename="config.json")
    except (NotAModel, Unreadable) as exc:
        # A LoRA repository: asked of the Hub only when it answered (an unreachable one would be
        # waited for again), else of the cache.
        adapter = _adapter_config(repo, revision, remote=isinstance(exc, NotAModel))
        if adapter is not None:
            raise ConfigError(KEY, repo, adapter_fix(adapter)) from None
        raise
    return refuse_quantized(json.loads(Path(path).read_text()), repo), Path(path).parent.name


def _adapter_config(repo: str, revision: str, remote: bool) -> bytes | None:
    """The repository's adapter_config.json (from the cache first; ``remote``: then the Hub), or
    None: not there, or the Hub cannot be asked."""
    from huggingface_hub import hf_hub_download

    for local in (True, False) if remote else (True,):
        try:
            return Path(hf_hub_download(repo, "adapter_config.json", revision=revision or None,
                                        local_files_only=local)).read_bytes()  # fmt: skip
        except Exception:  # noqa: BLE001 - not there, offline, unreachable: the first error stands
            continue
    return None


@functools.lru_cache(maxsize=16)
def snapshot(repo: str, revision: str = "", weights: bool = True) -> Path:
    """The repository's files on this node (in the Hugging Face cache); ``weights=False``: all
    but the weights (tokenizer, chat template, generation config). Once per process and
    revision; across processes the cache itself is shared (its per-file locks)."""
    from huggingface_hub import snapshot_download

    ignore = None if weights else list(WEIGHTS)
    return Path(_call(snapshot_download, repo, revision, ignore_patterns=ignore))


def weight_files(repo: str, revision: str = "") -> list[str] | None:
    """The repository's file names from the Hub, or None when the Hub cannot be asked (offline):
    the driver's early refusal of a repository without safetensors weights is then the
    workers' on load."""
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        return None
    try:
        return _call(HfApi().list_repo_files, repo, revision)
    except Unreadable:
        return None


def _call(fn, repo: str, revision: str, **kwargs):
    """``fn(repo_id=repo, revision=...)`` with the Hub's errors as ConfigErrors naming the key."""
    from huggingface_hub import errors

    try:
        return fn(repo_id=repo, revision=revision or None, **kwargs)
    except errors.RevisionNotFoundError:
        raise ConfigError(REVISION_KEY, revision, f"is not a branch, tag or commit of {repo} on the Hub") from None
    except errors.GatedRepoError:
        raise ConfigError(
            KEY, repo, f"is gated: accept its terms on huggingface.co/{repo} and export HF_TOKEN (a read token)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(
            KEY,
            repo,
            "is neither a directory here nor a model repository on the Hugging Face Hub (a private one needs "
            "HF_TOKEN in the environment)",
        ) from None
    except errors.RemoteEntryNotFoundError:
        raise NotAModel(KEY, repo, "has no config.json: not a transformers model repository") from None
    except errors.IncompleteSnapshotError:
        why = "has an incomplete snapshot in the Hugging Face cache (an interrupted download): download it again"
        raise ConfigError(KEY, repo, f"{why} with network (`hf download {repo}`)") from None
    except errors.LocalEntryNotFoundError:
        raise Unreadable(KEY, repo, _not_cached(repo, revision)) from None
    except errors.HfHubHTTPError as exc:  # a 5xx, a 401 with a bad token, ...
        status = exc.response.status_code if exc.response is not None else "?"
        raise Unreadable(KEY, repo, f"the Hugging Face Hub answered HTTP {status}; try again later") from None
    except Exception as exc:
        # The HTTP client's own connection errors (httpx's are not OSErrors), a socket's OSError.
        if isinstance(exc, OSError) or type(exc).__module__.startswith(("httpx", "requests", "urllib3")):
            raise Unreadable(KEY, repo, _not_cached(repo, revision)) from None
        raise


def _not_cached(repo: str, revision: str) -> str:
    """Why an offline (or unreachable) look-up failed: the repository or the revision is not in
    this machine's cache, with the revisions it does hold."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else "the Hugging Face Hub cannot be reached"
    refs = sorted(p.name for p in (folder / "refs").glob("*")) if folder.is_dir() else []
    snaps = sorted(p.name for p in (folder / "snapshots").glob("*")) if folder.is_dir() else []
    if not refs and not snaps:
        return (
            f"is not a directory here, and {why} and the Hugging Face cache ({constants.HF_HUB_CACHE}) does not "
            f"hold it: download it first (`hf download {repo}`, with network), or give a local directory"
        )
    held = ", ".join([*refs, *(f"commit {s[:12]}" for s in snaps)])
    return (
        f"revision {revision or 'main'!r} is not in the Hugging Face cache ({why}); the cache holds {held}: set "
        f"{REVISION_KEY} to one of them, or download that revision first (`hf download {repo} --revision "
        f"{revision or 'main'}`)"
    )
