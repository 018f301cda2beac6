"""The Hub as Stowage asks it: search, a repository's files, one file's bytes by range; errors as sentences.

Everything goes through `huggingface_hub` (HfApi, hf_hub_url, its HTTP session and headers), so HF_ENDPOINT,
HF_TOKEN and the login stored by `hf auth login` count as they do for every Hugging Face tool. HF_ENDPOINT is read
when a Hub is made, not when huggingface_hub was imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from huggingface_hub import HfApi, constants, get_token, hf_hub_url
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from ..errors import HubAccessError, HubError
from ..formats.config import SUPPORTED
from ..formats.gguf_model import ARCHITECTURES
from .files import RepoFiles, group_files, sibling_files, tree_files

try:  # the HTTP library huggingface_hub uses: httpx2 from 2.x, httpx before
    from httpx2 import TransportError
except ImportError:  # pragma: no cover
    from httpx import TransportError

SEARCH_PAGE = 100  # repositories asked for per search, before those Stowage cannot run are dropped
_EXPAND = ["downloads", "likes", "gated", "tags", "gguf", "config", "library_name", "pipeline_tag"]
WEIGHT_TAGS = frozenset({"gguf", "safetensors"})


@dataclass(frozen=True)
class RepoHit:
    """One search result: a repository Stowage can run, in GGUF or safetensors."""

    repo: str
    formats: tuple[str, ...]  # "gguf", "safetensors"
    architecture: str | None  # model_type or general.architecture, where the Hub says
    downloads: int
    likes: int
    gated: bool


class Hub:
    """One endpoint of the Hub and the token to use there (None: HF_TOKEN, else the stored login, else none)."""

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.token = token or get_token()
        self.api = HfApi(endpoint=self.endpoint, token=self.token or False)

    # -- asking --------------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 20) -> list[RepoHit]:
        """Repositories matching `text` with GGUF or safetensors weights of an architecture Stowage runs,
        most downloaded first."""
        with self.errors(what=f"searching for {text!r}"):
            found = list(self.api.list_models(search=text, sort="downloads", limit=SEARCH_PAGE, expand=_EXPAND))
        hits = [hit for hit in map(_hit, found) if hit is not None]
        return hits[:limit]

    def files(self, repo: str, revision: str | None = None) -> RepoFiles:
        """The repository's models (each GGUF file or split set, the safetensors set), by quantization, with sizes
        and hashes: from one model-info request, or its tree where the info does not give the files' sizes."""
        with self.errors(repo):
            info = self.api.model_info(repo, revision=revision, files_metadata=True)
            files = sibling_files(info)
            if files is None:
                files = tree_files(self.api.list_repo_tree(repo, revision=info.sha or revision, recursive=True))
        return group_files(repo, info, files, gated_note=self.gated_note(repo) if info.gated else None)

    @contextmanager
    def read(self, repo: str, revision: str, filename: str, start: int, end: int) -> Iterator[Iterator[bytes]]:
        """The bytes from `start` of a file (up to `end`, if the server honours Range), as a stream of chunks: the
        caller stops reading at `end`. A server that ignores Range sends the file from its start; what lies before
        `start` is skipped."""
        url = hf_hub_url(repo, filename, revision=revision, endpoint=self.endpoint)
        headers = self.headers() | {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        with self.errors(repo, filename):
            with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                skip = start if response.status_code != 206 else 0
                yield _skipped(response.iter_bytes(), skip)

    def headers(self) -> dict[str, str]:
        """What every request carries: huggingface_hub's user agent, and the token where there is one."""
        return build_hf_headers(token=self.token or False)

    def gated_note(self, repo: str) -> str:
        """What a gated repository asks of the user, in words."""
        page = f"{self.endpoint}/{repo}"
        if self.token:
            return (f"{repo} is gated: accept its conditions at {page} with the account of your token, "
                    "then try again (access may take a while to be granted)")
        return (f"{repo} is gated: accept its conditions at {page}, then log in with `hf auth login` "
                "(or set HF_TOKEN to a read token from https://huggingface.co/settings/tokens)")

    # -- errors --------------------------------------------------------------------------------------

    @contextmanager
    def errors(self, repo: str | None = None, filename: str | None = None, *, what: str | None = None):
        """huggingface_hub's and the network's exceptions as HubError / HubAccessError sentences."""
        where = f"{repo}/{filename}" if filename else repo or what or self.endpoint
        try:
            yield
        except GatedRepoError as e:
            raise HubAccessError(self.gated_note(repo or "this repository")) from e
        except RemoteEntryNotFoundError as e:
            raise HubError(f"{repo} has no file {filename!r}; `stowage plan {repo} --context N` lists the models "
                           "it has") from e
        except RevisionNotFoundError as e:
            raise HubError(f"{repo} has no such revision (branch, tag or commit)") from e
        except DisabledRepoError as e:
            raise HubError(f"{repo} has been disabled on {self.endpoint}") from e
        except RepositoryNotFoundError as e:
            login = "" if self.token else " (if it is private, log in with `hf auth login` or set HF_TOKEN)"
            raise HubError(f"no repository {repo!r} on {self.endpoint}{login}; check the name "
                           "(owner/name, as on its page)") from e
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status == 404:
                raise HubError(f"{where} was not found on {self.endpoint} (HTTP 404); check the repository and file "
                               "names") from e
            if status in (401, 403):
                raise HubAccessError(f"{self.endpoint} refused access to {where} (HTTP {status}): log in with "
                                     "`hf auth login` or set HF_TOKEN") from e
            raise HubError(f"{self.endpoint} failed on {where} (HTTP {status}); try again later") from e
        except OfflineModeIsEnabled as e:
            raise HubError("huggingface_hub is in offline mode (HF_HUB_OFFLINE is set); unset it to reach "
                           f"{self.endpoint}") from e
        except TransportError as e:
            raise HubError(f"cannot reach {self.endpoint} ({type(e).__name__}: {e}); check the connection, or "
                           "HF_ENDPOINT") from e


def _skipped(chunks: Iterator[bytes], num_bytes: int) -> Iterator[bytes]:
    for chunk in chunks:
        if num_bytes >= len(chunk):
            num_bytes -= len(chunk)
            continue
        yield chunk[num_bytes:]
        num_bytes = 0


def _hit(info) -> RepoHit | None:
    tags = set(info.tags or ())
    formats = tuple(sorted(tags & WEIGHT_TAGS))
    if not formats:
        return None
    gguf_arch = (info.gguf or {}).get("architecture") if isinstance(info.gguf, dict) else None
    model_type = (info.config or {}).get("model_type") if isinstance(info.config, dict) else None
    if gguf_arch is not None or model_type is not None:
        runs = gguf_arch in ARCHITECTURES or model_type in SUPPORTED
        arch = gguf_arch or model_type
    else:  # no config said: the Hub tags a transformers model with its model_type; with no tag either, the
        # verdict will tell (a server that does not expand gguf/config must not hide every GGUF repository)
        known = sorted(tags & (set(SUPPORTED) | set(ARCHITECTURES)))
        runs, arch = True, (known[0] if known else None)
    if not runs:
        return None
    return RepoHit(info.id, formats, arch, info.downloads or 0, info.likes or 0, bool(info.gated))
