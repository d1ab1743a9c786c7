"""MaxText 0.2.5's own train step as step specs: a tiny decoder with 8-way tensor-sequence parallelism, with
MaxText's default sharding (FSDP over every device), and with FSDP x tensor parallelism; the default decoder.

    cmtune problems --step examples/maxtext_step.py:tiny_maxtext_step --devices virtual:8
    cmtune problems --step examples/maxtext_step.py:tiny_fsdp_maxtext_step --devices virtual:8
    cmtune problems --step examples/maxtext_step.py:default_maxtext_step --devices tpu:v5e:2x4
    cmtune problems --step examples/maxtext_step.py:default_fsdp_maxtext_step --devices tpu:v5p:2x2x2

(Python 3.12 and ``pip install "maxtext[tpu]==0.2.5"``; `collective_matmul.client.maxtext` builds the step.)
"""

from collective_matmul.client import maxtext as cm_maxtext

SHAPE = ["base_emb_dim=256", "base_mlp_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=32",
         "base_num_decoder_layers=2", "max_target_length=128", "vocab_size=1024", "per_device_batch_size=1",
         "scan_layers=false", "attention=dot_product", "dtype=float32", "weight_dtype=float32"]
TINY = [*SHAPE, "ici_tensor_sequence_parallelism=8"]
# MaxText's default sharding: ici_fsdp_parallelism=-1, every device on the fsdp axis
TINY_FSDP = [*SHAPE, "ici_fsdp_parallelism=-1"]
TINY_FSDP_TP = [*SHAPE, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]


def tiny_maxtext_step(tuned=None, devices=None):
    """The tiny decoder: initialised on CPU devices (``verify --step``), abstract for a TPU topology."""
    return cm_maxtext.step_spec(TINY, tuned=tuned, devices=devices)


def tiny_fsdp_maxtext_step(tuned=None, devices=None):
    """The tiny decoder under MaxText's default sharding: FSDP over every device."""
    return cm_maxtext.step_spec(TINY_FSDP, tuned=tuned, devices=devices)


def tiny_fsdp_tp_maxtext_step(tuned=None, devices=None):
    """The tiny decoder with FSDP over 4 devices and tensor parallelism over 2."""
    return cm_maxtext.step_spec(TINY_FSDP_TP, tuned=tuned, devices=devices)


# MaxText's default decoder (base.yml: emb 2048, mlp 7168, 16 heads of 128) cut to 2 layers of sequence 2048, bfloat16.
DEFAULT_SHAPE = ["model_name=default", "base_num_decoder_layers=2", "max_target_length=2048",
                 "per_device_batch_size=1", "scan_layers=false", "attention=dot_product"]
DEFAULT = [*DEFAULT_SHAPE, "ici_tensor_sequence_parallelism=8"]


def default_maxtext_step(tuned=None, devices=None):
    """The default decoder, abstract (~250M parameters: its float32 state with Adam's moments is ~3 GB): for
    ``problems`` and compile-only runs."""
    return cm_maxtext.step_spec(DEFAULT, tuned=tuned, devices=devices, abstract=True)


def default_fsdp_maxtext_step(tuned=None, devices=None):
    """The default decoder under MaxText's default sharding (FSDP over every device), abstract."""
    return cm_maxtext.step_spec(DEFAULT_SHAPE, tuned=tuned, devices=devices, abstract=True)
