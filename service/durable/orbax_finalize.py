"""A CheckpointManager's step finalized by a daemon exactly as Orbax's primary process
finalizes it in the trainer, with Orbax's own code, when the trainer died first.

Orbax's commit callback (its ``AsyncCheckpointer``), in order: ``_CHECKPOINT_METADATA``
updated with the item handlers and custom metadata; each item's handler finalized (the
PyTree handlers merge the processes' OCDBT databases) and the item's temporary folder
finalized (``commit_success.txt``, renamed to its name); the step's temporary folder
finalized (its commit timestamp, ``commit_success.txt``, renamed to the step's name). Here
the same calls, on the record the trainer left (save_in_flight.Record). Each part is
done only where it is not done yet (an item already renamed is left), so a finalize cut
short (this daemon killed, the trainer killed half way through its own) is finished by
the next one. ``finalizing`` is written first: from then on the step is known whole,
while the parts' answers are being removed.
"""

import asyncio
import os

from bubblesnap.service.durable import checkpoint
from bubblesnap.service.durable import format as fmt
from bubblesnap.shared import checkpoint_record, save_in_flight
from bubblesnap.shared.save_in_flight import Record

_OCDBT_PREFIX = "ocdbt.process_"


def finalize(record: Record, pending: str) -> None:
    """Finalizes the step of ``record`` (its folder of the save in flight: ``pending``)."""
    fmt.orbax()
    from etils import epath
    from orbax.checkpoint._src.metadata import checkpoint as checkpoint_metadata
    from orbax.checkpoint._src.path import atomicity

    ts_utils, ocdbt_utils = checkpoint._orbax_modules()
    fmt.write_bytes(os.path.join(pending, save_in_flight.FINALIZING), b"")
    store = checkpoint_metadata.metadata_store(enable_write=True, blocking_write=True)
    store.update(file_path=checkpoint_metadata.step_metadata_file_path(record.tmp),
                 **record.metadata)
    for item in record.items:
        if not os.path.isdir(item.tmp):
            continue  # finalized by an earlier finalize of the step
        fmt.remove(os.path.join(item.tmp, checkpoint_record.STATE_DIR))
        if item.finalize == "ocdbt" and any(name.startswith(_OCDBT_PREFIX)
                                            for name in os.listdir(item.tmp)):
            asyncio.run(ocdbt_utils.merge_ocdbt_per_process_files(
                epath.Path(item.tmp), ts_context=ts_utils.get_ts_context(use_ocdbt=True),
                use_zarr3=item.use_zarr3, enable_validation=item.validate))
        asyncio.run(atomicity.AtomicRenameTemporaryPath(
            epath.Path(item.tmp), epath.Path(item.final)).finalize())
    asyncio.run(atomicity.AtomicRenameTemporaryPath(
        epath.Path(record.tmp), epath.Path(record.final),
        checkpoint_metadata_store=store).finalize())
