"""The dataset subcommands: `upload` an `.npz` (prints its id) and `datasets` (a table of yours)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mpjobs import Client
from mpjobs.cli.exit_codes import CliError, Exit
from mpjobs.cli.words import table


def cmd_upload(client: Client, args: argparse.Namespace) -> int:
    """Upload FILE.npz (arrays x and y) unless the server has its bytes; print its id."""
    path = Path(args.file)
    if not path.is_file():
        raise CliError(Exit.USAGE, f"Expected an .npz file holding arrays x and y. Received: {args.file!r}, "
                                   "which is not a file.")
    record = client.upload_file(path)
    print(record.id)
    return Exit.OK


def cmd_datasets(client: Client, args: argparse.Namespace) -> int:
    rows = [[d.id, d.created_at, "x".join(map(str, d.x.shape)), d.x.dtype, "x".join(map(str, d.y.shape)), d.y.dtype,
             f"{d.bytes:,}", str(len(d.jobs))] for d in client.datasets()]
    print(table(["ID", "UPLOADED", "X", "X DTYPE", "Y", "Y DTYPE", "BYTES", "JOBS"], rows) if rows else "no datasets")
    return Exit.OK
