"""bubblesnap: checkpoints for pipeline-parallel JAX training, taken in pipeline bubbles.

Packages: ``bubblesnap.service`` (the daemon), ``bubblesnap.clients`` (libraries
used inside training), ``bubblesnap.protos`` (the wire contract), ``bubblesnap.cli``
(the ``bubblesnap`` command), ``bubblesnap.run`` (the launcher and the Orbax patch),
``bubblesnap.testing`` (the harness that starts daemons, rings, hosts and stores as
processes) and ``bubblesnap.shared`` (what the daemon and the clients both use).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

#: Modules that moved into the packages: the old name still imports the same module
#: object, with a DeprecationWarning naming the new one.
MOVED = {
    "bubblesnap.cli_daemon": "bubblesnap.cli.daemon_command",
    "bubblesnap.cli_inspect": "bubblesnap.cli.inspect_command",
    "bubblesnap.cli_plan": "bubblesnap.cli.plan_command",
    "bubblesnap.huge_malloc": "bubblesnap.shared.huge_malloc",
    "bubblesnap.orbax_patch": "bubblesnap.run.orbax_patch",
    "bubblesnap.cluster": "bubblesnap.testing.cluster",
    "bubblesnap.object_stores": "bubblesnap.testing.object_stores",
    "bubblesnap.multihost": "bubblesnap.testing.multihost",
    "bubblesnap.history": "bubblesnap.testing.history",
    "bubblesnap.reaper": "bubblesnap.testing.reaper",
    "bubblesnap.sizes": "bubblesnap.shared.sizes",
    "bubblesnap.sockets": "bubblesnap.shared.sockets",
    "bubblesnap.options": "bubblesnap.shared.options",
    "bubblesnap.trainer_api": "bubblesnap.shared.trainer_api",
    "bubblesnap.heartbeat_file": "bubblesnap.shared.heartbeat_file",
    "bubblesnap.page_faults": "bubblesnap.shared.page_faults",
    "bubblesnap.checkpoint_record": "bubblesnap.shared.checkpoint_record",
    "bubblesnap.clients.jax.checkpoint_manager":
        "bubblesnap.clients.jax.manager.checkpoint_manager",
    "bubblesnap.clients.jax.manager_options": "bubblesnap.clients.jax.manager.manager_options",
    **{f"bubblesnap.clients.jax.{name}": f"bubblesnap.clients.jax.tier.{name}" for name in (
        "persist_future", "memory_tier", "tier_handler", "orbax_v1", "item_snapshot",
        "item_restore", "memory_steps", "checkpoint_tree")},
    **{f"bubblesnap.service.{name}": f"bubblesnap.service.restore.{name}" for name in (
        "assembly", "region_cut", "region_plan")},
    "bubblesnap.service.durable.object_storage": "bubblesnap.service.durable.storage.objects",
    "bubblesnap.service.durable.object_config":
        "bubblesnap.service.durable.storage.object_config",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of a name in :data:`MOVED` with the module it moved to."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets the old name's next
        return module

    def exec_module(self, module):
        # the module it moved to ran already; its own spec back (reload() reads it)
        module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_MovedModules())
