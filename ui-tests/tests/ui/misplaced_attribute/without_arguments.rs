// `#[amp]` without arguments, `#[amp = ...]` and an empty `#[amp()]` are refused with the forms to write.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp]
    a: amp::nn::Linear,
    #[amp = "fp16"]
    b: amp::nn::Linear,
    #[amp()]
    c: amp::nn::Linear,
}

fn main() {}
