"""The backend conformance kit: contract tests any hyperpar backend must pass.

Run it on a backend with::

    pytest --pyargs hyperpar.testing.conformance --hyperpar-backend=NAME [--hyperpar-emulate]

Collectives are checked on 1, 2 and 4 real processes -- as many as the backend can host here: a
backend with one device per rank skips the larger worlds, with the reason, on a host with fewer
devices; world size 1 always runs. Hooks, module detection and device facts are checked in the
test process itself. Every expected value is computed independently in the process from
the same deterministic inputs, so a wrong answer cannot pass.
"""
