"""MaxText 0.2.5's own train step as a step spec: a tiny decoder with 8-way tensor-sequence parallelism.

    cmtune problems --step examples/maxtext_step.py:tiny_maxtext_step --devices virtual:8
    cmtune problems --step examples/maxtext_step.py:default_maxtext_step --devices tpu:v5e:2x4

(Python 3.12 and ``pip install "maxtext[tpu]==0.2.5"``; `collective_matmul.client.maxtext` builds the step.)
"""

from collective_matmul.client import maxtext as cm_maxtext

TINY = ["base_emb_dim=256", "base_mlp_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=32",
        "base_num_decoder_layers=2", "max_target_length=128", "vocab_size=1024", "per_device_batch_size=1",
        "scan_layers=false", "attention=dot_product", "dtype=float32", "weight_dtype=float32",
        "ici_tensor_sequence_parallelism=8"]


def tiny_maxtext_step(tuned=None, devices=None):
    """The tiny decoder: initialised on CPU devices (``verify --step``), abstract for a TPU topology."""
    return cm_maxtext.step_spec(TINY, tuned=tuned, devices=devices)


# MaxText's default decoder (emb 8192, mlp 28672, 64 query and 8 kv heads) cut to 2 layers of sequence 2048, bfloat16.
DEFAULT = ["model_name=default", "base_num_decoder_layers=2", "max_target_length=2048", "per_device_batch_size=1",
           "scan_layers=false", "attention=dot_product", "ici_tensor_sequence_parallelism=8"]


def default_maxtext_step(tuned=None, devices=None):
    """The default decoder, abstract (its state is ~23 GB): for ``problems`` and compile-only runs."""
    return cm_maxtext.step_spec(DEFAULT, tuned=tuned, devices=devices, abstract=True)
