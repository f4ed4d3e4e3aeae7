"""Run a compiled pipeline's tasks as Argo does on a cluster: every task whose dependencies
have succeeded starts at once, each in its own process.

kfp.local runs a pipeline's tasks one at a time, in a topological order. That hides what a
cluster shows: two tasks that no dependency edge orders run at the same time there, and if
both use the run's pool (rollout, update, evaluate), both load engines onto one device.
``argo_parallelism`` swaps kfp.local's DAG runner (``kfp.local.orchestrator.dag_orchestrator.run_dag``,
kfp 2.17.3) for one that schedules as Argo's DAG template does, keeping kfp.local's own task
execution (``task_executor.execute_single_task``: its cache, its subprocess per task). A
pipeline whose edges are right gives the same results either way; one with a missing edge
runs two pool users at once here too.

Only flat DAGs of container tasks (what drmas compiles) are run this way; a pipeline with
nested DAGs, conditions or loops goes through kfp.local's enhanced orchestrator unchanged.
"""

from __future__ import annotations

import builtins
import concurrent.futures
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["argo_parallelism"]


def _run_dag_as_argo(
    pipeline_resource_name: str,
    dag_component_spec: Any,
    executors: dict,
    components: dict,
    dag_arguments: dict[str, Any],
    pipeline_root: str,
    runner: Any,
    unique_pipeline_id: str,
    fail_stack: list[str],
    parent_io_store: Any = None,
) -> tuple[dict[str, Any], Any]:
    """``dag_orchestrator.run_dag``'s signature and result, with Argo's scheduling: a task
    starts as soon as every task in its ``dependent_tasks`` has succeeded; after a failure no
    new task starts, the running ones finish, and the DAG fails naming the failed task."""
    from kfp.local import io, status  # noqa: PLC0415
    from kfp.local.orchestrator import task_executor  # noqa: PLC0415
    from kfp.local.orchestrator.orchestrator_utils import OrchestratorUtils  # noqa: PLC0415

    arguments = OrchestratorUtils.join_user_inputs_and_defaults(
        dag_arguments=dag_arguments, dag_inputs_spec=dag_component_spec.input_definitions
    )
    io_store = io.IOStore(parent=parent_io_store)
    for name, value in arguments.items():
        io_store.put_parent_input(name, value)
    tasks = dict(dag_component_spec.dag.tasks.items())
    waiting = {name: set(spec.dependent_tasks) for name, spec in tasks.items()}
    done: set[str] = set()
    failed: list[str] = []

    def execute(name: str):
        return task_executor.execute_single_task(
            task_name=name,
            task_spec=tasks[name],
            pipeline_resource_name=pipeline_resource_name,
            components=components,
            executors=executors,
            io_store=io_store,
            pipeline_root=pipeline_root,
            runner=runner,
            unique_pipeline_id=unique_pipeline_id,
            fail_stack=fail_stack,
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(tasks))) as pool:
        running: dict[concurrent.futures.Future, str] = {}

        def start_ready() -> None:
            for name in [name for name, needs in waiting.items() if needs <= done]:
                del waiting[name]
                running[pool.submit(execute, name)] = name

        start_ready()
        while running:
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                outputs, task_status = future.result()
                if task_status != status.Status.SUCCESS:
                    failed.append(name)
                    continue
                for key, output in outputs.items():
                    io_store.put_task_output(name, key, output)
                done.add(name)
            if not failed:
                start_ready()
    if failed:
        fail_stack.append(failed[0])
        return {}, status.Status.FAILURE
    if waiting:
        raise ValueError(f"tasks whose dependencies never ran (a cycle?): {sorted(waiting)}")
    outputs = OrchestratorUtils.get_dag_outputs(dag_outputs_spec=dag_component_spec.dag.outputs, io_store=io_store)
    return outputs, status.Status.SUCCESS


@contextmanager
def argo_parallelism() -> Iterator[None]:
    """Inside the block, kfp.local runs each flat DAG with Argo's scheduling.

    kfp.local indents a task's prints by replacing ``builtins.print`` for the task's
    duration (``logging_utils.indented_print``), which is not made for tasks that overlap:
    their replacements and restorations interleave and can leave an indenting ``print``
    behind. The one this block found is put back when it ends."""
    from kfp.local.orchestrator import dag_orchestrator  # noqa: PLC0415

    sequential, printing = dag_orchestrator.run_dag, builtins.print
    dag_orchestrator.run_dag = _run_dag_as_argo
    try:
        yield
    finally:
        dag_orchestrator.run_dag, builtins.print = sequential, printing
