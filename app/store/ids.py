"""Record ids: the store makes every job and comparison id, and says which text is one.

The format stays in the store, not in the wire contract (`mpjobs/contract`): the store makes the ids and
puts them into Redis keys, and an id of another form would name another record's key (`x:events`); the
API checks a path id against it before any key is built of it (app/api/params.py). To a client an id is
an opaque string it was given: the client never checks its form, so the contract need not spell it.
"""

from __future__ import annotations

import re
import uuid

RECORD_ID = re.compile(r"[0-9a-f]{32}")
"""Every job and comparison id: `uuid.uuid4().hex`. Only an id of this form may be put into a key."""


def new_record_id() -> str:
    """A new job or comparison id (app/store/jobs.py, comparisons.py)."""
    return uuid.uuid4().hex


def is_record_id(text: str) -> bool:
    return RECORD_ID.fullmatch(text) is not None
