"""The names of a decoder layer's linear projections and the groups of them that engines fuse."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections of one input that inference engines fuse into one matmul (vLLM: qkv_proj,
# gate_up_proj; with NVFP4 they must share one global scale) and that the rollout may store
# fused (`qerl_jax.linear.Fused`) under `qwen2.fused_name(group)`.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Tensor parallelism over a mesh's "model" axis (`qerl_jax.sharding`): these projections split
# their output features (column-parallel), the others their input features (row-parallel).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
