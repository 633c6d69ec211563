"""slime-rl trainer-megatron: the Megatron-core policy (and critic) trainer.

``MegatronTrainer`` lives in ``slime_rl.trainer_megatron.trainer`` (entry point
``slime_rl.trainers: megatron``)."""

import warnings

# megatron-core announces every optional fused backend it falls back from; the local spec needs none.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* (is|are) not installed")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")
