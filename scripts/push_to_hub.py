"""Upload an exported pipeline or LoRA folder (with its model card) to the Hugging Face Hub.

    python scripts/push_to_hub.py runs/NAME/current_pipeline --repo you/my-model [--private]
    python scripts/push_to_hub.py runs/NAME/current_pipeline --repo you/my-model --dry-run
    python scripts/push_to_hub.py runs/NAME/pipelines/step_00002000 --repo you/my-model \\
        --revision step-2000 --commit-message "step 2000"

The token comes from the environment: ``HF_TOKEN``, else huggingface_hub's own lookup (the file that
``hf auth login`` writes). The repository is created when missing (``--private``
applies then), and the folder's files are sent in one commit with huggingface_hub's ``create_commit`` (what
``upload_folder`` does), the model card's loading snippet pointing at the repo instead of the local folder.
``--dry-run`` lists the files and their sizes and the repo, with no token and no network.

Exit status: 0 sent (or listed), 2 a bad folder / repo name / no token, 3 the Hub refused or cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sd_training.outputs.model_card import CARD_FILE, LORA_WEIGHTS, PIPELINE_INDEX, export_kind, for_repo  # noqa: E402

LOGIN_HINT = "set HF_TOKEN (a write token from https://huggingface.co/settings/tokens) or run `hf auth login`"


class PushError(Exception):
    """A clear message and the exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="an exported pipeline (model_index.json) or LoRA folder "
                    "(pytorch_lora_weights.safetensors), e.g. runs/NAME/current_pipeline")
    ap.add_argument("--repo", required=True, help="the Hub repository, NAME or OWNER/NAME")
    ap.add_argument("--private", action="store_true",
                    help="create the repository private (an existing one stays as it is)")
    ap.add_argument("--dry-run", action="store_true", help="list what would be sent; no token, no network")
    ap.add_argument("--revision", default=None,
                    help="the branch to commit to (created from main when missing; default: main)")
    ap.add_argument("--commit-message", default=None,
                    help="the commit's message (default: 'Upload <folder> with sd-training')")
    return ap.parse_args(argv)


def files_to_send(folder: Path) -> list[tuple[str, Path]]:
    """(path in the repo, local file) of every file of ``folder``, but leftovers of interrupted writes (*.tmp)."""
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not any(part.endswith(".tmp") for part in rel.split("/")):
            out.append((rel, path))
    return out


def check_folder(folder: Path) -> str:
    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder: give an exported pipeline or LoRA folder "
                        "(runs/NAME/current_pipeline, runs/NAME/pipelines/step_N)")
    kind = export_kind(folder)
    if kind is None:
        raise PushError(f"{folder} is not an exported pipeline or LoRA folder: it holds neither {PIPELINE_INDEX} nor "
                        f"{LORA_WEIGHTS}. Push runs/NAME/current_pipeline (or pipelines/step_N) of a run")
    return kind


def check_repo(repo: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise PushError(f"--repo {repo!r} is not a Hub repository name: {e}") from None


def card_for_repo(folder: Path, repo: str) -> tuple[bytes | None, str]:
    """The README.md to send (its snippet names the repo) and a line saying what was done to it."""
    card = folder / CARD_FILE
    if not card.is_file():
        return None, f"no {CARD_FILE} (model card) in {folder}: the repository will have none"
    text, n = for_repo(card.read_text(encoding="utf-8"), folder, repo)
    note = (f"{CARD_FILE}: its loading snippet names {repo} instead of this folder ({n} place(s))" if n else
            f"{CARD_FILE}: sent as it is (its snippet does not name {folder.resolve()}: the folder was moved or the "
            "card is not this project's)")
    return text.encode("utf-8"), note


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def describe(args, kind: str, files: list[tuple[str, Path]], note: str) -> str:
    total = sum(p.stat().st_size for _, p in files)
    lines = [f"repo: {args.repo} (model, {'private' if args.private else 'public'} if created), "
             f"branch {args.revision or 'main'}; a {kind} folder: {Path(args.folder).resolve()}"]
    lines += [f"  {_size(p.stat().st_size):>10}  {rel}" for rel, p in files]
    lines += [f"{len(files)} files, {_size(total)}", note]
    return "\n".join(lines)


def upload(args, files: list[tuple[str, Path]], card: bytes | None) -> str:
    """Create the repo (and branch) when missing and send the files in one commit; returns the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token

    token = get_token()
    if not token:
        raise PushError(f"no Hugging Face token found: {LOGIN_HINT}")  # not "token: set", which reads as a header
    if constants.HF_HUB_OFFLINE:
        raise PushError("offline: HF_HUB_OFFLINE is set, so nothing can be sent to the Hub. Unset it (and check the "
                        "network) to push, or use --dry-run to list what would be sent", 3)
    api = HfApi(token=token)
    ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p)) for rel, p in files if rel != CARD_FILE]
    if card is not None:
        ops.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card))
    url = api.create_repo(args.repo, private=args.private, repo_type="model", exist_ok=True)
    if args.revision and args.revision != "main":
        api.create_branch(url.repo_id, branch=args.revision, exist_ok=True)
    message = args.commit_message or f"Upload {Path(args.folder).name} with sd-training"
    info = api.create_commit(url.repo_id, ops, commit_message=message, revision=args.revision, repo_type="model")
    return info.commit_url


def hub_error(e: Exception) -> PushError:
    """A clear message for what the Hub (or the way to it) answered."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return PushError(f"offline: {e}. Unset HF_HUB_OFFLINE to push", 3)
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return PushError(f"the Hub refused the token ({status}): {LOGIN_HINT} with a token that may write to "
                         f"this repository. {str(e).splitlines()[0]}", 3)
    if isinstance(e, HfHubHTTPError) and status is not None:
        return PushError(f"the Hub answered {status}: {str(e).splitlines()[0]}", 3)
    return PushError(f"cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {str(e)[:300]}). Check the "
                     "network, a proxy or HF_ENDPOINT, or push from a machine that reaches it", 3)


def main(argv=None) -> int:
    args = parse_args(argv)
    folder = Path(args.folder)
    try:
        kind = check_folder(folder)
        check_repo(args.repo)
        files = files_to_send(folder)
        card, note = card_for_repo(folder, args.repo)
        print(describe(args, kind, files, note))
        if args.dry_run:
            print("dry run: nothing sent")
            return 0
        try:
            url = upload(args, files, card)
        except PushError:
            raise
        except Exception as e:  # whatever the Hub or the transport raised: said in one line, not a traceback
            raise hub_error(e) from None
    except PushError as e:
        print(f"push_to_hub: error: {e}", file=sys.stderr)
        return e.status
    print(f"sent: {url}")
    return 0


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
