"""Vision-language support: the model's processor, images in the data, the rollout contract (docs/vlm.md)."""
