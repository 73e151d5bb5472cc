"""zerofit: fine-tune 7B-class LLMs on small GPUs with one exact global batch, on DeepSpeed ZeRO or FSDP2."""

__version__ = "0.1.0"
