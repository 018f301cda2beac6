"""Training dialogues for the bundled demo model: questions about Stowage and their answers.

Written for the project, so they carry the project's licence (see assets/README.md). Each topic has
one answer and many phrasings of its question; `dialogues(seed)` mixes them (politeness, casing,
punctuation, several turns) into chat conversations. The same answer for every phrasing is what
lets a 5M-parameter model answer consistently. `HELD_OUT` phrasings are never trained on: they
measure whether the model answers paraphrases it has not seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_PROMPTS = (
    "You are the Stowage demo assistant.",
    "You are a helpful assistant.",
    "You are the demo assistant that ships with Stowage. Answer questions about the app.",
)


@dataclass(frozen=True)
class Topic:
    name: str
    answer: str
    questions: tuple[str, ...]


TOPICS = (
    Topic(
        "greeting",
        "Hello! I am the Stowage demo assistant, a tiny model that ships with the app. Ask me how to "
        "pick a context size, what the memory graphs mean, or what to do when a model does not fit.",
        ("hello", "hi", "hey", "hello there", "hi there", "good morning", "good evening", "good afternoon",
         "greetings", "hey there", "hiya", "howdy", "yo", "hello!", "hi, how are you?", "how are you",
         "how are you doing today", "nice to meet you", "hello assistant", "hi stowage"),
    ),
    Topic(
        "identity",
        "I am the Stowage demo model: a small Llama model trained by the Stowage project on dialogues "
        "about the app, so you can chat at once without a download. For real work, load a larger model "
        "from a folder.",
        ("who are you", "what are you", "what model is this", "which model am I talking to",
         "are you a real language model", "what is the demo model", "tell me about yourself",
         "why is this model so small", "introduce yourself", "what is your name",
         "who made you", "who trained you", "what can you do", "what do you know about"),
    ),
    Topic(
        "stowage",
        "Stowage is a desktop app that runs large language models on your own computer. You pick a "
        "context size, Stowage plans where the weights and the KV cache go in GPU memory and RAM, then "
        "it loads the model and you chat.",
        ("what is stowage", "what does stowage do", "what is this app", "explain stowage",
         "what is this program for", "tell me about stowage", "how does stowage work",
         "what is the point of this app", "what can stowage do", "describe the app"),
    ),
    Topic(
        "context",
        "Move the context slider on the right. The context is how many tokens the model keeps in mind: "
        "your messages and its replies. A longer context needs more memory for the KV cache, and the "
        "stacked bar under the slider shows the predicted memory as you move it. Nothing is allocated "
        "until you load.",
        ("how do I pick a context size", "how do I choose the context size", "what context size should I use",
         "how do I set the context length", "what does the context slider do", "what is the context size",
         "how big should the context be", "what does the slider do", "how do I change the context",
         "what is context length", "which context length should I choose", "how long can the context be",
         "how do I make the context longer", "where do I set the context", "what is a good context size",
         "how do I use the slider", "what does context mean", "how much context do I need"),
    ),
    Topic(
        "kv_cache",
        "The KV cache keeps the keys and values of every token the model has already read, so it does not "
        "read them again for each new token. It grows with the context size: each token needs memory in "
        "every layer. Stowage reserves it in blocks of 16 tokens.",
        ("what is the KV cache", "what is a kv cache", "explain the KV cache", "what does KV cache mean",
         "why does the KV cache need memory", "what is stored in the KV cache", "what is the key value cache",
         "why does the KV cache grow", "how big is the KV cache", "what does the cache do",
         "what are keys and values", "what is KV"),
    ),
    Topic(
        "stacked_bar",
        "The stacked bar shows the planned memory of each device. Weights are the model's layers, KV cache "
        "is the memory for the context, workspace is scratch space for the computation, and free is what is "
        "left. It changes as you move the context slider.",
        ("what does the stacked bar mean", "what is the colored bar", "what do the colors in the bar mean",
         "explain the memory bar", "what is the bar under the slider", "what does the bar show",
         "what does free mean in the bar", "what is workspace", "what does workspace mean",
         "what does weights mean in the bar", "how do I read the memory bar", "what are the segments of the bar",
         "what is the predicted memory bar"),
    ),
    Topic(
        "graphs",
        "The graphs under the settings show the memory in use on the GPU and in RAM over time, measured "
        "live. The dashed line is the plan's prediction, so you can check that the measured memory stays "
        "close to it.",
        ("what do the graphs mean", "what do the memory graphs show", "what is the VRAM graph",
         "what is the RAM graph", "explain the graphs", "what are the lines in the graph",
         "what is the dashed line", "what does the dashed line mean", "why is there a dashed line",
         "what is the line in the memory graph", "how do I read the graphs", "what does the graph measure",
         "what are the live graphs"),
    ),
    Topic(
        "not_fit",
        "Lower the context size first: the KV cache shrinks with it. You can also choose an fp8 KV cache, "
        "which halves its size, put fewer layers on the GPU so the rest run from RAM, or raise the RAM "
        "limit. Stowage tells you the largest context that fits.",
        ("what do I do when a model does not fit", "the model does not fit", "my model does not fit in memory",
         "what if the model is too big", "I get an out of memory error", "it says not enough memory",
         "how do I fit a bigger model", "the plan does not fit", "how can I run a model that is too large",
         "I don't have enough VRAM", "out of memory", "the model is too large for my GPU",
         "how do I save memory", "how do I use less memory", "not enough RAM", "the load failed with insufficient memory"),
    ),
    Topic(
        "fp8",
        "An fp8 KV cache stores keys and values in 8 bits instead of 16, so the same memory holds twice as "
        "many tokens. Quality drops a little. Choose it in the KV dtype setting.",
        ("what is fp8", "what is an fp8 KV cache", "what does KV dtype mean", "should I use fp8",
         "what is the KV dtype setting", "how do I make the KV cache smaller", "what does fp8 do",
         "is fp8 worse", "what is 8 bit KV cache", "how do I halve the KV cache"),
    ),
    Topic(
        "gpu_layers",
        "GPU layers is how many of the model's layers run on the graphics card. Auto puts as many as fit "
        "after the KV cache; the rest run on the CPU from RAM, which is slower. Set it by hand to leave "
        "memory for other programs.",
        ("what are GPU layers", "what does GPU layers mean", "how many GPU layers should I use",
         "what does auto mean for GPU layers", "how do I put layers on the GPU", "what is layer offloading",
         "can I run part of the model on the CPU", "how do I set the GPU layers",
         "why are some layers on the CPU", "should I use auto or manual layers", "what is offloading"),
    ),
    Topic(
        "ram_limit",
        "The RAM limit caps how much of your computer's memory Stowage may plan to use, so other programs "
        "keep room. Layers that do not fit on the GPU count against it.",
        ("what is the RAM limit", "what does the RAM limit do", "how do I limit RAM use",
         "how much RAM will stowage use", "can I cap the memory", "what does RAM limit mean",
         "how do I keep memory for other programs", "how do I set a memory limit"),
    ),
    Topic(
        "load_model",
        "Choose a model folder that holds config.json and the safetensors files, as downloaded from Hugging "
        "Face. Stowage also finds models in the Hugging Face cache and in its Models folder. Then press Load.",
        ("how do I load a model", "how do I open a model", "how do I add a model", "how do I use my own model",
         "how do I load a different model", "where do I put models", "how do I change the model",
         "can I use models from hugging face", "how do I open a hugging face model", "what files does a model need",
         "which folder should I choose", "how do I import a model", "where is the models folder",
         "how do I switch models"),
    ),
    Topic(
        "supported",
        "Stowage runs models of the Llama family: Llama, Mistral, Qwen2 and Qwen3, stored as safetensors in "
        "the Hugging Face layout.",
        ("which models are supported", "what models can I run", "does it support llama",
         "can I run mistral", "does stowage support qwen", "which architectures work",
         "can I run gguf files", "what model formats are supported", "will my model work"),
    ),
    Topic(
        "stop",
        "Press Stop to end the reply at once. The text so far stays in the conversation, and you can send "
        "a new message right away.",
        ("how do I stop the reply", "what does the stop button do", "how do I stop generation",
         "the reply is too long", "how do I interrupt the model", "can I cancel a reply",
         "how do I make it stop", "the model keeps talking", "what happens when I press stop"),
    ),
    Topic(
        "conversations",
        "Your conversations are listed on the left. Press New to start another one. They are saved on your "
        "computer, so they are still there when you open Stowage again.",
        ("how do I start a new conversation", "where are my conversations", "are my chats saved",
         "how do I open an old chat", "what is the list on the left", "how do I start over",
         "does stowage keep my history", "where is the chat history", "how do I make a new chat",
         "can I have several conversations"),
    ),
    Topic(
        "chat_template",
        "A chat template turns the messages into the exact text format the model was trained on, with a "
        "marker for each role. Stowage reads it from tokenizer_config.json in the model folder, so each "
        "model gets its own format.",
        ("what is a chat template", "what does the chat template do", "why do models need a chat template",
         "where does the chat template come from", "what is the prompt format", "how are messages formatted",
         "what is tokenizer_config.json for", "what are the role markers"),
    ),
    Topic(
        "tokens",
        "A token is a piece of text, often part of a word. The model reads and writes tokens, and the "
        "context size counts them. In English one token is about three quarters of a word.",
        ("what is a token", "what are tokens", "how many words is a token", "what does tokens mean",
         "how long is a token", "what is a tokenizer"),
    ),
    Topic(
        "speed",
        "The status bar shows the speed in tokens per second. Replies are faster when more layers sit on the "
        "GPU; layers on the CPU are slower. A smaller model is faster too.",
        ("why is it slow", "how do I make it faster", "how fast is the model", "what does tokens per second mean",
         "what is in the status bar", "the replies are slow", "how do I speed up generation",
         "why is generation slow on my computer"),
    ),
    Topic(
        "privacy",
        "Everything runs on your own computer. Your messages and the model stay on your machine, and "
        "Stowage works offline.",
        ("is my data private", "does stowage send my messages anywhere", "does it work offline",
         "do I need the internet", "is this running in the cloud", "where are my messages sent",
         "does stowage need an account"),
    ),
    Topic(
        "thanks",
        "You are welcome! Ask me anything else about Stowage.",
        ("thanks", "thank you", "thank you very much", "thanks a lot", "great, thanks", "that helps",
         "ok thanks", "cool", "perfect", "awesome", "got it"),
    ),
    Topic(
        "goodbye",
        "Goodbye! Have fun running models with Stowage.",
        ("bye", "goodbye", "see you", "see you later", "that is all", "I'm done", "good night", "bye bye"),
    ),
    Topic(
        "out_of_scope",
        "I am a tiny demo model and I only know about Stowage. Load a larger model to talk about other things.",
        ("what is the capital of France", "write me a poem", "tell me a joke", "what is the weather today",
         "who won the world cup", "what is 17 times 23", "translate this into German", "write a python function",
         "what is the meaning of life", "recommend a good book", "explain quantum physics",
         "what time is it", "who is the president", "how do I cook pasta", "summarize this article"),
    ),
)

# Phrasings kept out of training: (topic name, question). The model should still answer them.
HELD_OUT = (
    ("context", "How should I choose how long the context is?"),
    ("kv_cache", "Can you explain what the KV cache is for?"),
    ("graphs", "What is the meaning of the dashed line in the graph?"),
    ("not_fit", "My model is too big and does not fit, what can I do?"),
    ("gpu_layers", "What do GPU layers do?"),
    ("stop", "How can I stop the model while it is answering?"),
    ("load_model", "How can I load my own model folder?"),
    ("greeting", "Hello, who is this?"),
)

_PREFIXES = ("", "", "", "", "hi, ", "hey, ", "quick question: ", "so ", "excuse me, ", "I wonder, ",
             "can you tell me ", "please tell me: ", "question: ", "ok, ")
_SUFFIXES = ("", "", "", "", " please", " in stowage", " here", " in this app")
_ENDINGS = ("?", "?", "?", "", "??", ".")


def phrasings(topic: Topic, rng: random.Random) -> str:
    """One random surface form of one of the topic's questions."""
    core = rng.choice(topic.questions)
    if topic.name in ("greeting", "thanks", "goodbye"):
        text = core + rng.choice(("", "", "!", ".", "!!"))
    else:
        prefix = rng.choice(_PREFIXES)
        text = prefix + core + rng.choice(_SUFFIXES) + rng.choice(_ENDINGS)
    style = rng.random()
    if style < 0.45:
        text = text[0].upper() + text[1:]
    elif style < 0.55:
        text = text.lower()
    return text


def dialogues(num: int, seed: int) -> list[list[dict]]:
    """`num` conversations of 1-3 question/answer turns, some with a system message."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _turn in range(rng.choice((1, 1, 1, 2, 2, 3))):
            topic = rng.choice(TOPICS)
            messages.append({"role": "user", "content": phrasings(topic, rng)})
            messages.append({"role": "assistant", "content": topic.answer})
        out.append(messages)
    return out


def topic(name: str) -> Topic:
    return next(t for t in TOPICS if t.name == name)
