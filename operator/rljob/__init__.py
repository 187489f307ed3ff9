"""rljob: a Kubernetes operator for RL post-training where an inference engine's rollout and training share
GPU pods."""

__version__ = "0.1.0"
