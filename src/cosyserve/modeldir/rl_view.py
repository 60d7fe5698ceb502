"""A view of a Fun-CosyVoice3 directory whose LM is the RL-tuned one (``llm.rl.pt``).

Upstream's loader, like ours, reads ``llm.pt``; the RL-tuned LM of Fun-CosyVoice3-0.5B-2512
has the same keys and shapes and loads the same way. The view is a directory of symlinks
to the original's files with ``llm.pt`` pointing at ``llm.rl.pt``, and a manifest of its
own (from the original's digests: nothing is hashed again), so that it is served, checked
and verified like any model directory, alone or beside the base model in one process (its
id is its directory's name).
"""

import shutil
from pathlib import Path

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.family import LLM_FILE
from cosyserve.modeldir.layout import LLM_RL_FILE, MANIFEST_FILE, ModelDir
from cosyserve.modeldir.manifest import read_manifest, write_manifest


def make_rl_view(source: Path, target: Path) -> Path:
    """Write the view of ``source`` at ``target`` (which must not exist); returns it.
    Raises :class:`ModelDirError` when ``source`` has no RL-tuned LM or no manifest."""
    model_dir = ModelDir.open(source)
    if model_dir.llm_rl is None:
        raise ModelDirError(
            f"{source} has no {LLM_RL_FILE}: only Fun-CosyVoice3 directories ship an RL-tuned LM"
        )
    if target.exists():
        raise ModelDirError(f"{target} already exists")
    digests = read_manifest(source)
    root = source.resolve()
    target.mkdir(parents=True)
    try:
        for entry in sorted(root.iterdir()):
            if entry.name in (LLM_FILE, LLM_RL_FILE, MANIFEST_FILE) or entry.name.startswith("."):
                continue
            (target / entry.name).symlink_to(entry)
        (target / LLM_FILE).symlink_to(root / LLM_RL_FILE)
        known = {name: digest for name, digest in digests.items() if name not in (LLM_FILE, LLM_RL_FILE)}
        if LLM_RL_FILE in digests:
            known[LLM_FILE] = digests[LLM_RL_FILE]
        write_manifest(target, known)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target
