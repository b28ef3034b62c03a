"""Push exported folders to the Hugging Face Hub with huggingface_hub's upload API.

One export goes to one revision (`main` unless `revision` says otherwise). A CR family (the folder
`python -m checkpoints export RUN --all` writes, one subfolder per snapshot) goes to one repository:
`final` to `main`, each `crK` (and `stepN`) to a branch of that name. The token is the one
huggingface_hub finds itself (HF_TOKEN or the stored login); it is never read, printed or logged here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from checkpoints.export import ExportError, folder_size

MAIN_SNAPSHOT = "final"  # the family member that becomes the repository's main branch


@dataclass
class Upload:
    folder: Path
    revision: str
    files: list[tuple[str, int]]  # (path inside the folder, bytes)


def plan_uploads(folder: str | Path, revision: str | None = None) -> list[Upload]:
    """What a push would send: one export, or each member of a CR family, with its target revision."""
    folder = Path(folder)
    if _is_export(folder):
        return [_upload(folder, revision or "main")]
    members = sorted(p for p in folder.iterdir() if p.is_dir() and _is_export(p)) if folder.is_dir() else []
    if not members:
        raise ExportError(f"{folder} is neither an exported model (config.json with a retrokv section) nor a folder of "
                          "them; export one with `python -m checkpoints export`")
    if revision is not None:
        raise ExportError(f"{folder} is a CR family: each member goes to its own branch ({MAIN_SNAPSHOT} to main, "
                          "crK to crK); --revision applies to a single export")
    return [_upload(p, "main" if p.name == MAIN_SNAPSHOT else p.name) for p in members]


def _is_export(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        return isinstance(json.loads(config.read_text()).get("retrokv"), dict)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{config} is corrupt: {err}") from None


def _upload(folder: Path, revision: str) -> Upload:
    files = sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())
    return Upload(folder, revision, files)


def push(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         api=None) -> list[str]:
    """Create the repository (and branches) if needed and upload; returns the commit URLs."""
    from huggingface_hub import HfApi

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ExportError(f"--repo-id {repo_id!r} is invalid; expected ORG/NAME (or USER/NAME)")
    uploads = plan_uploads(folder, revision)
    api = api or HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    urls = []
    for upload in uploads:
        if upload.revision != "main":
            api.create_branch(repo_id, branch=upload.revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(upload.folder), repo_type="model",
                                 revision=upload.revision, commit_message=f"RetroKV export {upload.folder.name}")
        urls.append(str(getattr(info, "commit_url", info)))
    return urls


def describe(uploads: list[Upload], repo_id: str) -> str:
    """The dry run's listing: per revision, each file and its size."""
    lines = []
    for upload in uploads:
        total = folder_size(upload.folder)
        lines.append(f"{repo_id}@{upload.revision} <- {upload.folder} ({len(upload.files)} files, {_size(total)})")
        lines += [f"  {name}\t{_size(size)}" for name, size in upload.files]
    return "\n".join(lines)


def _size(n: float) -> str:
    """Bytes in decimal units, as the Hub shows them."""
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
