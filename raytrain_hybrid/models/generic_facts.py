"""What transformers says of each causal-LM family that resolving a config reads, as data.

Resolving a config of a generic family (models.generic) asks its classes for their tensor-parallel
and pipeline plans, the base model's and the head's names, whether the attention takes SDPA or
sinks, and reads a checkpoint's sizes through the config class's attribute names. Asking the classes
imports the family's modeling code, and with it torch: about 5 s of every `check` of a Qwen3 or
Gemma checkpoint on a small machine, against half a second for a hand-written family.
``scripts/generic_facts.py`` records these answers in assets/generic_facts.json for the installed
transformers version; they are read from there when that version is the one installed and the family
was not registered in this process (models.custom), and from the classes otherwise. A test derives
every family's facts afresh (``derive``) and compares them with the file.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import json
from pathlib import Path

FACTS = Path(__file__).parents[1] / "assets" / "generic_facts.json"
# The sizes a config resolves to (models.generic.sizes_from_hf), by the attribute names it reads.
SIZE_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
_OVERRIDDEN: set[str] = set()  # model_types registered in this process (models.custom): their classes


@functools.cache
def _file() -> dict:
    try:
        installed = importlib.metadata.version("transformers")
        data = json.loads(FACTS.read_text())
    except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
        return {}
    return data if data.get("transformers") == installed else {}


def recorded(model_type: str) -> dict | None:
    """The recorded facts of ``model_type``, or None (read its classes)."""
    if model_type in _OVERRIDDEN:
        return None
    return (_file().get("families") or {}).get(model_type)


def version() -> str:
    """The installed transformers' version, as the recorded facts say it (no import of transformers)."""
    if _file():
        return _file()["transformers"]
    import transformers

    return transformers.__version__


def overridden(model_type: str) -> None:
    """``model_type`` was registered in this process: its classes answer from now on."""
    _OVERRIDDEN.add(model_type)
    _classes_and_tiny_model.cache_clear()  # (what its former classes answered)


def derive(model_type: str) -> dict:
    """The facts of ``model_type`` from its classes (what the file records for it)."""
    from raytrain_hybrid.models import generic
    from raytrain_hybrid.models.generic_forward import per_layer_modules

    config_cls, lm_cls = generic.classes(model_type)
    facts: dict = {"tp_plan": dict(config_cls.base_model_tp_plan or {})}
    facts["pp_plan"] = bool(getattr(config_cls, "base_model_pp_plan", None))
    try:
        facts["pp_names"] = list(generic.pp_names_of(model_type))
    except (KeyError, StopIteration) as exc:
        facts["pp_names"] = None
        facts["pp_error"] = str(exc)
    if facts["pp_names"] and norms_embeddings(model_type, *facts["pp_names"][1:]):
        facts["pre_norm"] = True  # (recorded where true only: the other families' facts unchanged)
    facts["head"] = generic.head_name_of(lm_cls)
    facts["prefix"] = prefix_of(lm_cls)
    model = _tiny_model(config_cls, lm_cls, _tiny(model_type, config_cls))
    if kept := _buffers(model):
        facts["buffers"] = kept  # (recorded where there are some, as pre_norm)
    if facts["pp_names"] and (whole := _tp_whole(model, facts)):
        facts["tp_whole"] = whole  # (likewise)
    facts["sdpa"] = bool(getattr(lm_cls, "_supports_sdpa", False))
    source = inspect.getsource(inspect.getmodule(lm_cls))
    facts["sinks"] = "s_aux" in source or "sinks=" in source
    facts["per_layer"] = list(per_layer_modules(config_cls))
    facts["attribute_map"] = dict(getattr(config_cls, "attribute_map", {}) or {})
    try:
        default = config_cls()
    except Exception:  # noqa: BLE001 - a family whose default config does not build (matrix: refused)
        facts["sizes_from_class"] = True
        return facts
    facts["absent"] = [k for k in SIZE_KEYS if _missing(default, k, facts["attribute_map"])]
    # The sizes as data must be the class's, also with each size set apart from the others (a class
    # that derives one, latent attention's head_dim, from other keys): else read through its class.
    tiny = _tiny(model_type, config_cls)
    probes = [(default.to_dict(), True), (tiny, True), *((c, False) for c in _apart(tiny, facts["attribute_map"]))]
    for conf, must_build in probes:
        try:
            same = conf is not None and sizes(model_type, conf, facts) == generic.sizes_from_class(model_type, conf)
        except Exception:  # noqa: BLE001 - the class refuses these sizes (Gemma 3n's per-layer widths)
            same = not must_build  # (a size changed alone that the class refuses tells nothing)
        if not same:
            facts["sizes_from_class"] = True
            break
    return facts


def buffers(model_type: str) -> list[str]:
    """The state-dict entries of the family's model that are buffers, not parameters, as patterns
    ("*" for a block's or an expert's index): recorded, else read off its classes."""
    facts = recorded(model_type)
    if facts is not None:
        return facts.get("buffers", [])
    return _buffers(_classes_and_tiny_model(model_type)[2])


def tp_whole(model_type: str) -> list[str]:
    """A block's weights, as patterns under the base model ("layers.*.self_attn.qkv_proj.weight"),
    that no style of the tensor-parallel plan splits, outside a mixture of experts (which
    generic_split keeps whole apart): MiniMax's linear attention, Youtu's latent attention. Every tp
    rank holds them whole and computes them whole. Recorded, else read off its classes."""
    facts = recorded(model_type)
    if facts is not None:
        return facts.get("tp_whole", [])
    from raytrain_hybrid.models import generic

    config_cls, lm_cls, model = _classes_and_tiny_model(model_type)
    names = {"pp_names": list(generic.pp_names(model_type)), "prefix": prefix_of(lm_cls)}
    return _tp_whole(model, names | {"tp_plan": dict(config_cls.base_model_tp_plan or {})})


@functools.cache
def _classes_and_tiny_model(model_type: str):
    """(config class, causal LM class, its tiny model on the meta device or None) of a family whose
    facts are not recorded: built once a process (cleared when the family is registered)."""
    from raytrain_hybrid.models import generic

    config_cls, lm_cls = generic.classes(model_type)
    return config_cls, lm_cls, _tiny_model(config_cls, lm_cls, _tiny(model_type, config_cls))


def _tiny_model(config_cls, lm_cls, tiny: dict | None):
    """The family's model built on the meta device from a tiny config, or None where it does not build."""
    import torch

    if tiny is None:  # (a family whose tiny config its class refuses: the matrix refuses it too)
        return None
    # (a family whose defaults leave its routed and shared experts unset, dots1: a few, as the matrix's
    # checkpoint; one whose first dense layers are more than the tiny model's two, DeepSeek-V3: one)
    unset = {k: 4 for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in tiny and tiny[k] is None}
    unset |= {"num_experts_per_tok": 2} if unset and tiny.get("num_experts_per_tok") is None else {}
    unset |= (
        {"n_shared_experts": 1} if unset and "n_shared_experts" in tiny and tiny["n_shared_experts"] is None else {}
    )
    if (tiny.get("first_k_dense_replace") or 0) >= tiny.get("num_hidden_layers", 2):
        unset["first_k_dense_replace"] = 1
    try:
        with torch.device("meta"):
            return lm_cls(config_cls(**(tiny | unset)))
    except Exception:  # noqa: BLE001 - a family whose model does not build so: refused by the matrix
        return None


def _buffers(model) -> list[str]:
    """The persistent buffers of the model (in its state dict, and so in a checkpoint's files beside
    the parameters: a router's score-correction bias, an activation's constants, MiniMax's decay
    tables), which the planner's count off the files leaves out as transformers' count does."""
    import re

    if model is None:
        return []
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return sorted({re.sub(r"\.\d+\.", ".*.", k) for k in model.state_dict(keep_vars=True) if k not in params})


# The plan's styles that split a module's weights over the tp ranks (or, moe_tp_experts, mark a
# mixture of experts, which generic_split keeps whole and the planner counts apart).
_SPLITTING = ("colwise", "rowwise", "moe_tp_experts")


def _tp_whole(model, facts: dict) -> list[str]:
    """tp_whole of the model built: its blocks' matrices (a norm's or a bias's vector is a rounding
    error) that no splitting entry of the plan covers, outside the block children holding experts."""
    import re

    if model is None:
        return []
    layers = facts["pp_names"][1]
    plan = [k for k, style in facts["tp_plan"].items() if any(s in style for s in _SPLITTING)]
    covered = [re.compile("^" + re.escape(k).replace(r"\*", r"\d+") + r"(\.|$)") for k in plan]
    experts = {
        k.removeprefix(f"{layers}.*.").split(".")[0] for k, s in facts["tp_plan"].items() if s == "moe_tp_experts"
    }
    try:
        blocks = model.get_submodule(f"{facts['prefix']}.{layers}")
    except AttributeError:  # (a base model whose blocks its pipeline plan names otherwise, HRM's: refused)
        return []
    whole = set()
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            full = f"{layers}.{i}.{name}"
            if p.dim() >= 2 and name.split(".")[0] not in experts and not any(c.match(full) for c in covered):
                whole.add(re.sub(r"\.\d+\.", ".*.", full))  # (each parameter: nested modules counted once)
    return sorted(whole)


def prefix_of(lm_cls) -> str:
    """The causal LM's attribute holding its base model: its base_model_prefix, unless its own
    __init__ sets ``self.model`` and not that (Llama 4's text LM names "language_model", the
    multimodal model's attribute, and holds ``self.model``)."""
    prefix = lm_cls.base_model_prefix or "model"
    try:
        init = inspect.getsource(lm_cls.__init__)
    except (OSError, TypeError):  # (no source: a class made at run time)
        return prefix
    return "model" if f"self.{prefix} =" not in init and "self.model =" in init else prefix


def state_space(config_cls) -> bool:
    """Whether the family has state-space (Mamba) layers, as its config's settings say (Bamba, Jamba,
    Falcon-H1, Nemotron-H: names that do not say so)."""
    fields = {k for c in config_cls.__mro__ for k in getattr(c, "__annotations__", {})}
    return any(k.startswith(("mamba_", "ssm_")) for k in fields)


@functools.cache
def pre_norm(model_type: str) -> bool:
    """Whether the family's base model applies its final norm to the embeddings too, before its layers
    (NanoChat's "additional norm before the layers"): recorded, else read off its classes."""
    facts = recorded(model_type)
    if facts is not None:
        return bool(facts.get("pre_norm"))
    from raytrain_hybrid.models import generic

    return norms_embeddings(model_type, *generic.pp_names(model_type)[1:])


def norms_embeddings(model_type: str, layers: str, norm: str) -> bool:
    """The base model's forward, before its loop over ``layers``, passes the hidden states through
    ``norm`` (read in its source)."""
    import re

    base = _base_class(model_type)
    try:
        source = inspect.getsource(base.forward) if base else ""
    except (OSError, TypeError):
        return False
    before = re.split(rf"for \w+ in self\.{layers}\b", source, maxsplit=1)
    return len(before) == 2 and f"hidden_states = self.{norm}(hidden_states)" in before[0]


def _base_class(model_type: str):
    """The family's base model class (transformers' MODEL_MAPPING_NAMES), or None."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from raytrain_hybrid.models import generic

    name = MODEL_MAPPING_NAMES.get(model_type)
    module = inspect.getmodule(generic.classes(model_type)[1])
    return getattr(module, name, None) if isinstance(name, str) else None


def final_norm_of(model_type: str) -> str:
    """A base model without a pipeline plan: its final norm, the last norm its __init__ sets
    (``norm``; LFM2's ``embedding_norm``, which it applies last)."""
    import re

    base = _base_class(model_type)
    try:
        norms = re.findall(r"self\.(\w+) = \w*Norm\w*\(", inspect.getsource(base.__init__)) if base else []
    except (OSError, TypeError):
        norms = []
    return norms[-1] if norms else "norm"


def _missing(config, key: str, attribute_map: dict) -> bool:
    """Whether the config class has no such attribute at all (GPT-2 has no head_dim): read as None."""
    if attribute_map.get(key, key) in config.to_dict():
        return False
    try:
        return getattr(config, key, None) is None
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error
        return True


def _apart(conf: dict | None, names: dict) -> list[dict]:
    """``conf`` with each size present changed alone (a class deriving it from other keys then
    disagrees with the data)."""
    if conf is None:
        return []
    out = []
    for key, new in (("head_dim", 8), ("num_key_value_heads", 1), ("intermediate_size", 96), ("num_hidden_layers", 3)):
        name = names.get(key, key)
        if isinstance(conf.get(name), int) and conf[name] != new:
            out.append({**conf, name: new})
    return out


def _tiny(model_type: str, config_cls) -> dict | None:
    """A small config of the family as save_pretrained writes it (model.* sizes as the matrix's)."""
    from types import SimpleNamespace

    from raytrain_hybrid.models import generic

    m = SimpleNamespace(vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, seq_len=32)  # fmt: skip
    try:
        return config_cls(**generic.tiny_kwargs(m, model_type)).to_dict()
    except Exception:  # noqa: BLE001 - a family with other required keys: its default config decides
        return None


def sizes(model_type: str, conf: dict, facts: dict | None = None) -> dict | None:
    """A config.json's model.* sizes read as data (as models.generic.sizes_from_hf reads them through
    the class); None where the facts are not recorded or the file lacks a key the class would fill in."""
    facts = facts if facts is not None else recorded(model_type)
    if not facts or facts.get("sizes_from_class"):
        return None
    names, absent = facts["attribute_map"], set(facts.get("absent", ()))
    got = {}
    for key in SIZE_KEYS:
        name = names.get(key, key)
        if name in conf:
            got[key] = conf[name]
        elif key in absent or key == "num_layers":  # (num_layers: LongCat-Flash's blocks; no other's)
            got[key] = None
        else:
            return None
    heads, hidden, layers = got["num_attention_heads"], got["hidden_size"], got["num_hidden_layers"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden, layers)):
        return None  # (the class says what is wrong)
    fewer = got["num_layers"]
    if any(got[key] is None and key not in absent and key != "num_layers" for key in got):
        return None  # (null where the class has the key: the class decides, or refuses it)
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in got.values()):
        return None  # (a width per layer, a string: the class reads it)
    return {
        "num_layers": fewer if isinstance(fewer, int) and 0 < fewer < layers else layers,
        "hidden_size": int(hidden),
        "num_heads": int(heads),
        "num_kv_heads": int(got["num_key_value_heads"] or heads),
        "head_dim": int(got["head_dim"] or hidden // heads),
        "ffn_hidden_size": int(got["intermediate_size"] or 4 * hidden),
        "vocab_size": int(got["vocab_size"]),
    }
