"""An EAGLE head's checks (speculative_config method "eagle" / "eagle3"), and a multi-token-
prediction layer's ("mtp"), on the config.json alone: everything the worker could not run is
refused before a weight is read."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from pagedllm.config import ModelConfig
from pagedllm.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_eagle_head(spec: SpeculativeConfig, hf_config: PretrainedConfig, target: ModelConfig) -> None:
    """What an EAGLE head must be to draft for the target. Its context becomes the target's
    (``max_position_embeddings``; vLLM does the same: public heads say 2048 positions, and their
    rotary embedding extends like any Llama's)."""
    # Imported here: EngineArgs' module does not import torch until a config is made.
    from pagedllm.models.llama_eagle import eagle3_aux_layer_ids

    field = f"speculative_config.model {spec.model!r}"
    if getattr(hf_config, "model_type", None) != "llama":
        raise ValueError(
            f"{field} is a {hf_config.model_type!r} model: EAGLE heads in the Llama layout are supported"
        )
    for key in ("hidden_size", "target_hidden_size"):
        size = getattr(hf_config, key, None)
        if size is not None and size != target.hidden_size:
            raise ValueError(
                f"{field} has {key} {size}, the target's hidden_size is {target.hidden_size}: an EAGLE "
                "head reads the target's hidden states and must be trained for this target"
            )
    if hf_config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{field} has a vocabulary of {hf_config.vocab_size} tokens, the target's has "
            f"{target.vocab_size}: an EAGLE head must share the target's vocabulary"
        )
    draft_vocab = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
    if draft_vocab > hf_config.vocab_size:
        raise ValueError(f"{field} has draft_vocab_size {draft_vocab} > vocab_size {hf_config.vocab_size}")
    if spec.method == "eagle3":
        num_layers = target.num_layers
        layer_ids = eagle3_aux_layer_ids(hf_config, num_layers)
        if len(layer_ids) != 3 or not all(0 <= i < num_layers for i in layer_ids):
            raise ValueError(
                f"{field}: EAGLE-3 reads the hidden states entering three target layers, got layers "
                f"{list(layer_ids)} of a target with {num_layers} (eagle_aux_hidden_state_layer_ids)"
            )
    own_len = getattr(hf_config, "max_position_embeddings", None) or 0
    hf_config.max_position_embeddings = max(own_len, target.max_model_len)


def mtp_head_config(
    spec: SpeculativeConfig, hf_config: PretrainedConfig, target: ModelConfig
) -> PretrainedConfig:
    """The config the MTP head is built from (models/mtp.py): the checkpoint's, its layer count
    one (the draft's KV cache holds one layer) and the layer's checkpoint number kept aside."""
    from pagedllm.models import get_model_class
    from pagedllm.models.glm4_moe import SkipsMtpLayers

    field = f"speculative_config method 'mtp' (model {spec.model or target.model!r})"
    num_mtp_layers = getattr(hf_config, "num_nextn_predict_layers", None) or 0
    if num_mtp_layers < 1:
        raise ValueError(
            f"{field}: the config has no multi-token-prediction layer (num_nextn_predict_layers 0)"
        )
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_class = get_model_class(architectures, getattr(hf_config, "model_type", None))
    if not issubclass(model_class, SkipsMtpLayers):
        raise ValueError(
            f"{field}: {model_class.__name__}'s multi-token-prediction layers are not supported "
            "(DeepSeek-V3's and GLM-4-MoE's are)"
        )
    for key in ("hidden_size", "vocab_size"):
        ours, targets = getattr(hf_config, key), getattr(target.hf_config, key)
        if ours != targets:
            raise ValueError(
                f"{field} has {key} {ours}, the target's is {targets}: the layer drafts from the "
                "target's hidden states"
            )
    config = copy.deepcopy(hf_config)
    config.mtp_layer_index = hf_config.num_hidden_layers
    config.num_hidden_layers = 1
    config.max_position_embeddings = max(config.max_position_embeddings, target.max_model_len)
    return config
