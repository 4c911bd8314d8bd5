"""RULER's prompt text, transcribed word for word from NVIDIA/RULER (commit c3f5e3b):

  scripts/data/synthetic/constants.py  TASKS[...]['template'] / ['answer_prefix'] / ['tokens_to_generate']
  scripts/data/synthetic/niah.py       the needle (line 83), the noise haystack (line 89), the singular
                                       rewrite for one asked value (lines 193-198), the query join (189)
  scripts/data/synthetic/variable_tracking.py  the chain lines (108-112), the noise (86)
  scripts/data/synthetic/common_words_extraction.py  the numbered list (96), the example's answer (120)
  scripts/data/synthetic/freq_words_extraction.py    the noise word '...' (81)

RULER builds `template + answer_prefix` (prepare.py line 101: the model template wraps the task template,
the answer prefix follows it) and sends `input + answer_prefix` to the model (pred/call_api.py line 305).
"""

from __future__ import annotations

# constants.py lines 25-47
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
    "magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize "
    "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
    "above list?"
)
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}

# niah.py line 83 (also the lines of the 'needle' haystack, line 91) and line 89
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# variable_tracking.py lines 108-112 (the hop line ends with a space, as there)
VT_VALUE = "VAR {var} = {value}"
VT_HOP = "VAR {var} = VAR {prev} "
# freq_words_extraction.py line 81: the top-ranked "word" is noise (three dots; the question says four)
FWE_NOISE = "..."


def singular(template: str, type_needle_v: str) -> tuple[str, str]:
    """niah.py lines 193-198, for one asked value (num_needle_q * num_needle_v == 1): the template reads
    singular ('A special magic number is hidden ... What is the special magic number for ...'). RULER
    applies it to its whole template string (model template included); here to the task text only."""
    for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(a, b)
    return template, type_needle_v[:-1]


def join_query(queries: list[str]) -> str:
    """niah.py line 189: 'a', 'a, b, and c'."""
    return ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
