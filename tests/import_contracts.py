"""An import-linter contract type for what its own `forbidden` cannot say.

import-linter sees an external package as one module (`tensorflow`), so a
`forbidden` contract cannot name `tensorflow.python` alone. This contract reads
the line of each direct import of the package instead (grimp keeps it) and
fails on one that names a forbidden submodule, outside the allowed modules.
Registered in pyproject.toml ([tool.importlinter] contract_types); `lint-imports`
finds it with this directory on the path (tests/ops/test_layout.py sets it).
"""

from __future__ import annotations

import re

from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class ForbiddenSubmodulesContract(Contract):
    """Modules under `source_modules`, but not under `allowed_modules`, import no `forbidden_modules`.

    `forbidden_modules` are dotted names inside an external package
    ("tensorflow.python"); only direct imports are checked: going through an
    allowed module is the point.
    """

    type_name = "forbidden_submodules"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False)
    forbidden_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        allowed = list(self.allowed_modules or [])
        violations = []
        for forbidden in self.forbidden_modules:
            package = forbidden.split(".")[0]
            # `from tensorflow.python.x import y`, `import tensorflow.python.x`, `from tensorflow import python`
            named = re.compile(
                rf"\b{re.escape(forbidden)}\b|from\s+{re.escape(forbidden.rsplit('.', 1)[0])}\s+import\s+"
                rf"(?:.*[\s,(])?{re.escape(forbidden.rsplit('.', 1)[1])}\b"
            )
            if package not in graph.modules:
                continue
            for importer in sorted(graph.find_modules_that_directly_import(package)):
                if not any(_within(importer, source) for source in self.source_modules):
                    continue
                if any(_within(importer, ok) for ok in allowed):
                    continue
                for detail in graph.get_import_details(importer=importer, imported=package):
                    if named.search(detail["line_contents"]):
                        violations.append((importer, detail["line_number"], detail["line_contents"]))
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        from importlinter.application import output

        for importer, line, contents in check.metadata["violations"]:
            output.print_error(f"{importer}:{line}: {contents}", bold=False)
            output.new_line()


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")
