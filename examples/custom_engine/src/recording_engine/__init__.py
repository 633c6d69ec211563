"""A slime-rl rollout engine that records every request and response of another engine to JSONL."""

from recording_engine.engine import RecordingEngine

__all__ = ["RecordingEngine"]
