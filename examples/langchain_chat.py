"""LangChain's `ChatOpenAI`, unchanged, pointed at `cadenza serve` (pip install langchain-openai).

make serve          # in another terminal
python examples/langchain_chat.py
"""

from __future__ import annotations

from _connection import API_KEY, BASE_URL, MODEL
from langchain_openai import ChatOpenAI


def main() -> None:
    llm = ChatOpenAI(base_url=BASE_URL, api_key=API_KEY, model=MODEL, max_tokens=48, temperature=0)
    reply = llm.invoke([("system", "Answer in one sentence."), ("human", "What does a tokenizer do?")])
    print(reply.content)
    for chunk in llm.stream("Count from one to five."):
        print(chunk.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
