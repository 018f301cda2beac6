"""Running a loaded model: weights on their devices, the transformer, the paged KV cache, the native CPU decode
step, sampling, and `Engine`, which loads a plan and owns all of them."""
