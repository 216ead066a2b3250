"""The step's slot and token state inside each vLLM worker: which tokens of a step run with which adapter
(``token_mapping``), the adapted tokens grouped by slot (``groups``), what each slot holds and the kernels' plans
(``state``), the computations over the groups (``lora``: a kernel or ``torch_path``), the kernels' warm-up
(``warmup``) and the torch custom ops the model calls (``ops``)."""
