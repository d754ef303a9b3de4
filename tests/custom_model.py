"""A model that is not on the Hub: a transformers-compatible causal LM of its own, with its own
tensor-parallel plan (its MLP's output gathered, its down projection splitting a whole input, the
attention column/row-wise), written as a user would and trained through models.custom.register_model
(tests/test_models.py). Workers import it by name, as Ray Train's workers do."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel


class TinyDecoderConfig(LlamaConfig):
    model_type = "rh_tiny_decoder"
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise_gather_output",
        "layers.*.mlp.up_proj": "colwise_gather_output",
        "layers.*.mlp.down_proj": "rowwise_split_input",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }


class TinyDecoderModel(LlamaModel):
    config_class = TinyDecoderConfig


class TinyDecoderForCausalLM(LlamaForCausalLM):
    config_class = TinyDecoderConfig

    def __init__(self, config: TinyDecoderConfig) -> None:
        super().__init__(config)
        self.model = TinyDecoderModel(config)
        self.post_init()
