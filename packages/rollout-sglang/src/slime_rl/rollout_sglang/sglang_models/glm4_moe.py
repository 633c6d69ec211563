"""SGLang's GLM-4.5 MoE, its routers' float32 copies refreshed after every load (model_fixes.refresh_float32_copies)."""

from sglang.srt.models import glm4_moe

from slime_rl.rollout_sglang.model_fixes import refresh_float32_copies


class Glm4MoeForCausalLM(glm4_moe.Glm4MoeForCausalLM):
    def load_weights(self, weights, *args, **kwargs):
        loaded = super().load_weights(weights, *args, **kwargs)
        refresh_float32_copies(self)
        return loaded


EntryClass = Glm4MoeForCausalLM
