"""SGLang's Llama, loading block-FP8 scales under their own name (model_fixes.load_block_scales)."""

from sglang.srt.models import llama

from slime_rl.rollout_sglang.model_fixes import load_block_scales


class LlamaForCausalLM(llama.LlamaForCausalLM):
    def load_weights(self, weights, *args, **kwargs):
        return super().load_weights(load_block_scales(self, weights), *args, **kwargs)


EntryClass = LlamaForCausalLM
