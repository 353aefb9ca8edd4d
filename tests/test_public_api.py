"""Every name hyperpar advertises resolves, and importing hyperpar resolves no backend."""

import subprocess
import sys

import hyperpar


def test_every_name_in_all_resolves():
    missing = [name for name in hyperpar.__all__ if getattr(hyperpar, name, None) is None]
    assert not missing, missing


def test_public_names_are_documented():
    undocumented = [
        name for name in hyperpar.__all__
        if not name.startswith("__") and callable(getattr(hyperpar, name))
        and not getattr(hyperpar, name).__doc__
    ]
    assert not undocumented, undocumented


def test_import_does_not_select_a_backend():
    code = ("import hyperpar, hyperpar.parallel, hyperpar.pipeline, hyperpar.dtensor\n"
            "from hyperpar.platform import registry\n"
            "assert registry._state.platform is None and registry._state.backends is None\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_attribute_is_an_attribute_error():
    try:
        hyperpar.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_seed_project_names_are_exported():
    """DeepSpeed's and EasyDeL's names (the seeds) resolve where their docs put them."""
    import hyperpar.parallel as parallel
    import hyperpar.pipeline as pipeline

    for name in ("PipelineEngine", "initialize", "RepeatingLoader", "ProcessTopology",
                 "PipeDataParallelTopology", "PipeModelDataParallelTopology",
                 "LayerSpecTypeError"):
        assert name in pipeline.__all__ and getattr(pipeline, name).__doc__, name
    for name in ("ParallelLinear", "TensorParallelConfig", "get_sharding",
                 "get_matmul_output_sharding", "get_output_partition_spec",
                 "matmul_output_placements"):
        assert name in parallel.__all__ and getattr(parallel, name).__doc__, name
    for name in ("ParallelLinear", "TensorParallelConfig", "PipelineEngine"):
        assert name in hyperpar.__all__ and getattr(hyperpar, name) is not None


def test_plan_errors_and_the_driver_are_one_object_on_every_framework():
    """``hyperpar.PlanKeyError`` (and the other plan errors, and ``parallelize_module``) come
    from the framework-neutral driver: no backend picks its own class. The MindSpore side of
    this check is ``tests/mindspore/test_tensor_parallel.py``."""
    from hyperpar.parallel import driver, spec

    assert hyperpar.PlanKeyError is spec.PlanKeyError is driver.PlanKeyError
    assert hyperpar.parallelize_module is driver.parallelize_module
    assert hyperpar.parallel.parallelize_module is driver.parallelize_module
    for name in ("PlanKeyError", "UnsupportedModuleError", "AlreadyParallelizedError",
                 "TiedParameterError", "parallelize_module"):
        assert name not in hyperpar._FRAMEWORK_BOUND, name
        assert getattr(hyperpar, name) is getattr(driver, name), name
    from hyperpar.torch.dtensor.module import AlreadyParallelizedError

    assert AlreadyParallelizedError is driver.AlreadyParallelizedError
