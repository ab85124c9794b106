"""A synthetic engine: a scheduler simulator that writes real ledger records, with known faults.

Test and benchmark support only (it is not part of the package installed into vLLM images):
the tests, `bench/` and `make demo-synthetic` run it from a checkout.
"""
