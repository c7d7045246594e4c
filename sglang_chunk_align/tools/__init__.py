"""User tools: the `sglang-chunk-align` command (cli), `verify` against running servers,
`probe` of the installed flashinfer on a GPU (fa2: one planned fa2 call), and their argument
checks. Plugin loading never imports this package (tests/test_loading.py); it may use the
runtime package above it and the harness beside it (doctor builds stand-in backends).
"""
