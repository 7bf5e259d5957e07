"""Tensor-parallel plans by model family, in one place (torchtitan keeps one
`parallelize_<family>` per model; Hugging Face models declare theirs in their config):

- `attention.py`  what an attention module is: a module with a head count and projections
                  (nn.Linear, or transformers' Conv1D, weight stored in x out), and the shape
                  attributes its forward reads (head counts, widths).
- `declared.py`   a model's own plan (HF `config.base_model_tp_plan` / the model's `_tp_plan`)
                  mapped onto torch's ParallelStyles, under the path the HF model sits at.
- `derived.py`    the plan by heads from the repeated blocks where none is declared, a user's
                  `--tp-plan`, the fused qkv rows' order; `parallelize`: the one way a plan
                  is put on a model (the ranks and the proof both call it).
- `conv1d.py`     Conv1D's column- and row-wise styles (Shard(1)/Shard(0) swapped).
- `mha_swap.py`   torch's nn.MultiheadAttention as one fused qkv Linear.
- `local_width.py` an attention forward that reads its width off its input (nanoGPT's
                  `B, T, C = x.size()`) sees the rank's width.
- `proof.py`      every plan run before launch on a tiny forward, n ranks as threads of one
                  process, against the unsharded module.
- `shares.py`     which modules a plan shards and each block's sharded share (for predict).
"""
