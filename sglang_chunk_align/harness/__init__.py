"""Harness: real SGLang objects driven without a GPU or a model, for `doctor`, the tests and the
benchmarks (standins: backends and schedulers built without __init__; scheduler_driver: the real
PrefillAdder and scheduler steps over a workload). Plugin loading never imports this package
(tests/test_loading.py); it uses only the runtime package above it.
"""
