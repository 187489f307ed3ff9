"""SGLang on the trainer's side: the payloads its `update_weights_from_tensor` reads (packing.py), and the
digest of the weights as its `/weights_checker` will hash them (digest.py, tensor_hash.py)."""
