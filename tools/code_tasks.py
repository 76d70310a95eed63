"""Function-completion tasks no training of the project has seen: a signature and docstring (the
prompt) and a plain reference body (the continuation), in the style of HumanEval but written for
this project. `fusion eval` scores each body after its prompt (lm-evaluation-harness's convention:
the prompt's final newline moves to the body, prompt + body are encoded together) as bits per byte.

`tests/test_evaluation.py` runs every body against its examples, so the references are correct.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CodeTask:
    name: str
    prompt: str  # signature and docstring, ending in a newline
    body: str  # the reference body, indented
    checks: tuple[tuple[tuple, object], ...]  # (arguments, expected result)


def _task(name: str, signature: str, doc: str, body: str, checks) -> CodeTask:
    prompt = f"{signature}\n    \"\"\"{doc}\n    \"\"\"\n"
    return CodeTask(name, prompt, body, tuple(checks))


TASKS: tuple[CodeTask, ...] = (
    _task("count_vowels", "def count_vowels(word: str) -> int:",
          "Return how many letters of `word` are vowels (a, e, i, o, u), ignoring case.\n"
          "    >>> count_vowels('Banana')\n    3",
          "    return sum(1 for ch in word.lower() if ch in \"aeiou\")\n",
          [(("Banana",), 3), (("xyz",), 0), (("AEIOU",), 5)]),
    _task("running_max", "def running_max(values: list[int]) -> list[int]:",
          "Return a list whose i-th item is the largest of values[0..i].\n"
          "    >>> running_max([3, 1, 4, 1, 5])\n    [3, 3, 4, 4, 5]",
          "    result = []\n    best = None\n    for value in values:\n"
          "        if best is None or value > best:\n            best = value\n        result.append(best)\n"
          "    return result\n",
          [(([3, 1, 4, 1, 5],), [3, 3, 4, 4, 5]), (([],), []), (([-2, -5],), [-2, -2])]),
    _task("is_palindrome_number", "def is_palindrome_number(n: int) -> bool:",
          "Return True when the decimal digits of the non-negative integer n read the same backwards.\n"
          "    >>> is_palindrome_number(1221)\n    True",
          "    digits = str(n)\n    return digits == digits[::-1]\n",
          [((1221,), True), ((123,), False), ((7,), True)]),
    _task("chunk", "def chunk(items: list, size: int) -> list[list]:",
          "Split items into consecutive lists of `size` items; the last one may be shorter.\n"
          "    >>> chunk([1, 2, 3, 4, 5], 2)\n    [[1, 2], [3, 4], [5]]",
          "    return [items[i:i + size] for i in range(0, len(items), size)]\n",
          [(([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]]), (([], 3), []), (([1, 2], 5), [[1, 2]])]),
    _task("word_lengths", "def word_lengths(sentence: str) -> dict[str, int]:",
          "Map each distinct word of the sentence (split on whitespace) to its length.\n"
          "    >>> word_lengths('to be or not')\n    {'to': 2, 'be': 2, 'or': 2, 'not': 3}",
          "    lengths = {}\n    for word in sentence.split():\n        lengths[word] = len(word)\n"
          "    return lengths\n",
          [(("to be or not",), {"to": 2, "be": 2, "or": 2, "not": 3}), (("",), {})]),
    _task("second_smallest", "def second_smallest(numbers: list[int]) -> int | None:",
          "Return the second smallest distinct value, or None when there are fewer than two.\n"
          "    >>> second_smallest([4, 1, 3, 1])\n    3",
          "    distinct = sorted(set(numbers))\n    if len(distinct) < 2:\n        return None\n"
          "    return distinct[1]\n",
          [(([4, 1, 3, 1],), 3), (([2, 2],), None), (([5, -1, 0],), 0)]),
    _task("caesar_shift", "def caesar_shift(text: str, shift: int) -> str:",
          "Shift every lowercase letter of text by `shift` places in the alphabet, wrapping around;\n"
          "    leave other characters unchanged.\n    >>> caesar_shift('abc xyz', 2)\n    'cde zab'",
          "    out = []\n    for ch in text:\n        if \"a\" <= ch <= \"z\":\n"
          "            out.append(chr((ord(ch) - ord(\"a\") + shift) % 26 + ord(\"a\")))\n"
          "        else:\n            out.append(ch)\n    return \"\".join(out)\n",
          [(("abc xyz", 2), "cde zab"), (("Hi!", 1), "Hj!"), (("a", -1), "z")]),
    _task("digit_sum", "def digit_sum(n: int) -> int:",
          "Return the sum of the decimal digits of n (its sign ignored).\n    >>> digit_sum(-472)\n    13",
          "    total = 0\n    n = abs(n)\n    while n:\n        total += n % 10\n        n //= 10\n"
          "    return total\n",
          [((-472,), 13), ((0,), 0), ((9999,), 36)]),
    _task("merge_sorted", "def merge_sorted(left: list[int], right: list[int]) -> list[int]:",
          "Merge two ascending lists into one ascending list.\n"
          "    >>> merge_sorted([1, 4, 9], [2, 3, 10])\n    [1, 2, 3, 4, 9, 10]",
          "    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
          "        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += 1\n"
          "        else:\n            merged.append(right[j])\n            j += 1\n"
          "    merged.extend(left[i:])\n    merged.extend(right[j:])\n    return merged\n",
          [(([1, 4, 9], [2, 3, 10]), [1, 2, 3, 4, 9, 10]), (([], [1]), [1]), (([2, 2], [2]), [2, 2, 2])]),
    _task("count_runs", "def count_runs(text: str) -> list[tuple[str, int]]:",
          "Run-length encode text: each maximal run of one character as (character, length).\n"
          "    >>> count_runs('aaabcc')\n    [('a', 3), ('b', 1), ('c', 2)]",
          "    runs = []\n    for ch in text:\n        if runs and runs[-1][0] == ch:\n"
          "            runs[-1] = (ch, runs[-1][1] + 1)\n        else:\n            runs.append((ch, 1))\n"
          "    return runs\n",
          [(("aaabcc",), [("a", 3), ("b", 1), ("c", 2)]), (("",), []), (("abab",), [("a", 1), ("b", 1)] * 2)]),
    _task("transpose", "def transpose(matrix: list[list[int]]) -> list[list[int]]:",
          "Return the transpose of a rectangular matrix given as a list of rows.\n"
          "    >>> transpose([[1, 2, 3], [4, 5, 6]])\n    [[1, 4], [2, 5], [3, 6]]",
          "    if not matrix:\n        return []\n"
          "    return [[row[c] for row in matrix] for c in range(len(matrix[0]))]\n",
          [(([[1, 2, 3], [4, 5, 6]],), [[1, 4], [2, 5], [3, 6]]), (([],), []), (([[7]],), [[7]])]),
    _task("first_repeated", "def first_repeated(items: list) -> object:",
          "Return the first item that appears a second time while scanning left to right, or None.\n"
          "    >>> first_repeated(['x', 'y', 'z', 'y', 'x'])\n    'y'",
          "    seen = set()\n    for item in items:\n        if item in seen:\n            return item\n"
          "        seen.add(item)\n    return None\n",
          [((["x", "y", "z", "y", "x"],), "y"), (([1, 2, 3],), None), (([0, 0],), 0)]),
)


def run_checks(task: CodeTask) -> None:
    """Run the reference body on the task's examples; raise AssertionError on a wrong result."""
    namespace: dict = {}
    exec(task.prompt + task.body, namespace)  # the package's own reference code
    function = namespace[task.name]
    for args, expected in task.checks:
        got = function(*args)
        assert got == expected, f"{task.name}{args} = {got!r}, expected {expected!r}"
