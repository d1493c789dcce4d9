"""Pretrained checkpoints into sharded models: ``load_pretrained`` fills a model
(sharded by either front door, possibly built on the meta device) from a Hugging
Face safetensors checkpoint, each rank reading only its own shards' bytes;
``hf_model_on_meta`` builds the matching transformers model without allocating
its weights. See docs/pretrained.md."""

from flatfsdp.pretrained.hf_model import hf_model_from_config, hf_model_on_meta, hf_unit_classes
from flatfsdp.pretrained.load import LoadReport, load_pretrained

__all__ = ["LoadReport", "hf_model_from_config", "hf_model_on_meta", "hf_unit_classes", "load_pretrained"]
