"""The backend conformance kit: contract tests any hyperpar backend must pass.

Run it on a backend with::

    pytest --pyargs hyperpar.testing.conformance --hyperpar-backend=NAME [--hyperpar-emulate]

Collectives are checked on 2 and 4 real processes; hooks, module detection and device facts in
the test process itself. Every expected value is computed independently in the process from
the same deterministic inputs, so a wrong answer cannot pass.
"""
