"""Model architectures (settings spec §3): parameter counts, body/head contract, head choices."""
import pytest
import torch
from torch import nn

from pfedkit.data.datasets import default_model
from pfedkit.models import (MODELS, build_model, last_linear, layer_state_dict,
                            load_layer_state_dict, model_names)

MNIST = (1, 28, 28)
CIFAR = (3, 32, 32)

# (name, input_shape, num_classes, options) for one small configuration of every model
CONFIGS = [
    ("mlp", MNIST, 10, {}),
    ("mlp", (64,), 10, {}),
    ("cnn", MNIST, 10, {}),
    ("cnn", CIFAR, 100, {}),
    ("cnn_bn", MNIST, 10, {}),
    ("cnn_bn", CIFAR, 10, {}),
    ("alexnet", CIFAR, 10, {}),
    ("resnet18", CIFAR, 10, {}),
    ("resnet18", CIFAR, 10, {"stem": "imagenet"}),
    ("resnet18", CIFAR, 10, {"stem": "imagenet", "conv_stride": 1, "pool_stride": 4}),
    ("cnn_cifar", CIFAR, 10, {}),
    ("cnn_cifar100", CIFAR, 20, {}),
    ("cnn_proto", MNIST, 10, {}),
]
CONFIG_IDS = [f"{name}-{'x'.join(map(str, shape))}-{options}" for name, shape, _, options in CONFIGS]


def count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def build_seeded(name, input_shape, num_classes, head="last", seed=0, **options):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(name, input_shape, num_classes, head=head, **options).eval()


def example_batch(input_shape, batch_size=3):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, *input_shape, generator=generator)


# ---- parameter counts from the spec tables ------------------------------------------------------

@pytest.mark.parametrize("name, input_shape, num_classes, options, total", [
    ("mlp", MNIST, 10, {}, 199_210),
    ("cnn", MNIST, 10, {}, 582_026),
    ("cnn", CIFAR, 10, {}, 878_538),
    ("cnn", CIFAR, 100, {}, 924_708),
    ("cnn", (3, 64, 64), 200, {}, 5_694_600),
    ("cnn_bn", MNIST, 10, {}, 583_242),
    ("cnn_bn", CIFAR, 10, {}, 879_754),
    ("alexnet", CIFAR, 10, {}, 3_868_746),
    ("resnet18", CIFAR, 10, {}, 11_173_962),
    ("resnet18", CIFAR, 10, {"stem": "imagenet"}, 11_181_642),
    ("resnet18", CIFAR, 100, {"stem": "imagenet"}, 11_227_812),
    ("resnet18", (3, 64, 64), 200, {"stem": "imagenet"}, 11_279_112),
    ("cnn_cifar", CIFAR, 10, {}, 307_842),
    ("cnn_cifar100", CIFAR, 20, {}, 1_064_724),
    ("cnn_proto", MNIST, 10, {}, 21_840),
    ("cnn_proto", MNIST, 10, {"c2": 18}, 19_738),
    ("cnn_proto", MNIST, 10, {"c2": 22}, 23_942),
])
def test_parameter_count_matches_spec(name, input_shape, num_classes, options, total):
    for head in MODELS[name].heads:
        assert count(build_model(name, input_shape, num_classes, head=head, **options)) == total


@pytest.mark.parametrize("name, input_shape, num_classes, head, options, body, head_count", [
    ("alexnet", CIFAR, 10, "fc", {}, 978_496, 2_890_250),
    ("resnet18", CIFAR, 10, "last", {}, 11_168_832, 5_130),
    ("resnet18", CIFAR, 10, "last", {"stem": "imagenet"}, 11_176_512, 5_130),
    ("cnn", CIFAR, 10, "last", {}, 2_432 + 51_264 + 819_712, 5_130),
    ("cnn", CIFAR, 10, "fc", {}, 2_432 + 51_264, 819_712 + 5_130),
])
def test_body_and_head_counts_match_spec(name, input_shape, num_classes, head, options, body,
                                         head_count):
    model = build_model(name, input_shape, num_classes, head=head, **options)
    assert (count(model.body), count(model.head)) == (body, head_count)


@pytest.mark.parametrize("name, input_shape, head, options, feature_dim", [
    ("mlp", MNIST, "last", {}, 200),
    ("mlp", MNIST, "fc", {}, 784),
    ("cnn", MNIST, "last", {}, 512),
    ("cnn", MNIST, "fc", {}, 64 * 4 * 4),
    ("cnn", CIFAR, "fc", {}, 64 * 5 * 5),
    ("cnn_bn", MNIST, "last", {}, 512),
    ("cnn_bn", MNIST, "fc", {}, 64 * 4 * 4),
    ("alexnet", CIFAR, "last", {}, 512),
    ("alexnet", CIFAR, "fc", {}, 2304),
    ("resnet18", CIFAR, "last", {}, 512),
    ("cnn_cifar", CIFAR, "last", {}, 64),
    ("cnn_cifar100", CIFAR, "last", {}, 128),
    ("cnn_proto", MNIST, "last", {}, 50),
    ("cnn_proto", MNIST, "fc", {}, 16 * 20),
    ("cnn_proto", (1, 128, 128), "fc", {"kernel": 3, "c2": 20}, 841 * 20),
])
def test_feature_dim_matches_spec(name, input_shape, head, options, feature_dim):
    assert build_model(name, input_shape, 10, head=head, **options).feature_dim == feature_dim


# ---- the body/head contract ----------------------------------------------------------------------

@pytest.mark.parametrize("head", ["last", "fc"])
@pytest.mark.parametrize("name, input_shape, num_classes, options", CONFIGS, ids=CONFIG_IDS)
def test_forward_is_head_of_body_with_declared_shapes(name, input_shape, num_classes, options,
                                                      head):
    model = build_seeded(name, input_shape, num_classes, head=head, **options)
    x = example_batch(input_shape)
    with torch.no_grad():
        features = model.body(x)
        logits = model(x)
        assert features.shape == (3, model.feature_dim)
        assert logits.shape == (3, num_classes)
        torch.testing.assert_close(model.head(features), logits, rtol=0, atol=0)


@pytest.mark.parametrize("head", ["last", "fc"])
@pytest.mark.parametrize("name, input_shape, num_classes, options", CONFIGS, ids=CONFIG_IDS)
def test_every_parameter_belongs_to_body_or_head(name, input_shape, num_classes, options, head):
    model = build_model(name, input_shape, num_classes, head=head, **options)
    names = [key for key, _ in model.named_parameters()]
    assert names and all(key.startswith(("body.", "head.")) for key in names)
    assert any(key.startswith("head.") for key in names)


@pytest.mark.parametrize("name, input_shape, num_classes, options", CONFIGS, ids=CONFIG_IDS)
def test_head_choices_split_the_same_function(name, input_shape, num_classes, options):
    last = build_seeded(name, input_shape, num_classes, head="last", seed=0, **options)
    fc = build_seeded(name, input_shape, num_classes, head="fc", seed=1, **options)
    assert count(last) == count(fc)
    assert layer_state_dict(last).keys() == layer_state_dict(fc).keys()
    load_layer_state_dict(fc, layer_state_dict(last))
    x = example_batch(input_shape)
    with torch.no_grad():
        torch.testing.assert_close(fc(x), last(x), rtol=0, atol=0)


@pytest.mark.parametrize("name, input_shape, num_classes, options", CONFIGS, ids=CONFIG_IDS)
def test_last_head_is_the_final_linear_layer(name, input_shape, num_classes, options):
    model = build_model(name, input_shape, num_classes, head="last", **options)
    classifier = last_linear(model)
    assert (classifier.in_features, classifier.out_features) == (model.feature_dim, num_classes)
    assert sum(isinstance(layer, nn.Linear) for layer in model.head.modules()) == 1
    assert count(model.head) == count(classifier)


def test_fc_head_holds_every_linear_layer():
    for name, input_shape, num_classes, options in CONFIGS:
        model = build_model(name, input_shape, num_classes, head="fc", **options)
        assert not any(isinstance(layer, nn.Linear) for layer in model.body.modules()), name


def test_initialisation_follows_the_callers_seed():
    first = build_seeded("cnn", MNIST, 10, seed=3)
    again = build_seeded("cnn", MNIST, 10, seed=3)
    other = build_seeded("cnn", MNIST, 10, seed=4)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key])
    assert not torch.equal(first.body.conv1.weight, other.body.conv1.weight)
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    build_model("cnn_proto", MNIST, 10)
    assert not torch.equal(state, torch.random.get_rng_state())  # drew from the global RNG, no reseed


# ---- architecture details --------------------------------------------------------------------------

def layer_types(model: nn.Module) -> list[str]:
    return [type(layer).__name__ for part in (model.body, model.head) for layer in part]


def test_alexnet_keeps_reference_layer_order_without_relus_between_conv3_to_conv5():
    model = build_model("alexnet", CIFAR, 10)
    assert layer_types(model) == [
        "Conv2d", "MaxPool2d", "ReLU", "Conv2d", "MaxPool2d", "ReLU", "Conv2d", "Conv2d", "Conv2d",
        "MaxPool2d", "ReLU", "Flatten", "Linear", "Linear", "Linear"]
    pool5 = model.body.pool5
    assert (pool5.kernel_size, pool5.stride) == (3, 2)


def test_cnn_proto_layer_order_and_dropout():
    model = build_model("cnn_proto", MNIST, 10)
    assert layer_types(model) == [
        "Conv2d", "MaxPool2d", "ReLU", "Conv2d", "Dropout2d", "MaxPool2d", "ReLU", "Flatten",
        "Linear", "ReLU", "Dropout", "Linear"]
    assert model.body.conv2_drop.p == 0.5 and model.head.dropout.p == 0.5
    assert build_model("cnn_proto", (1, 128, 128), 62, kernel=3).body.conv1.kernel_size == (3, 3)


def test_cnn_bn_is_cnn_with_batchnorm_before_each_hidden_relu():
    model, plain = build_model("cnn_bn", MNIST, 10), build_model("cnn", MNIST, 10)
    assert layer_types(model) == [
        "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Flatten",
        "Linear", "BatchNorm1d", "ReLU", "Linear"]
    shapes = {key: value.shape for key, value in model.named_parameters() if ".bn" not in key}
    assert shapes == {key: value.shape for key, value in plain.named_parameters()}


def test_resnet_stems():
    cifar = build_model("resnet18", CIFAR, 10)
    assert cifar.body.conv1.kernel_size == (3, 3) and not hasattr(cifar.body, "maxpool")
    imagenet = build_model("resnet18", CIFAR, 10, stem="imagenet", conv_stride=1, pool_stride=4)
    assert imagenet.body.conv1.kernel_size == (7, 7) and imagenet.body.conv1.stride == (1, 1)
    assert imagenet.body.maxpool.stride == 4
    assert count(imagenet) == 11_181_642
    assert sum(isinstance(layer, nn.BatchNorm2d) for layer in cifar.modules()) == 1 + 8 * 2 + 3


def test_dropout_is_off_in_eval_mode_and_on_in_train_mode():
    model = build_seeded("cnn_proto", MNIST, 10)
    x = example_batch(MNIST, batch_size=8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
        model.train()
        assert not torch.equal(model(x), model(x))


# ---- registry and errors -------------------------------------------------------------------------

def test_registry_lists_every_model_with_a_one_line_description():
    assert model_names() == list(MODELS)
    assert set(model_names()) == {"mlp", "cnn", "cnn_bn", "alexnet", "resnet18", "cnn_cifar",
                                  "cnn_cifar100", "cnn_proto", "fasttext"}
    for name, info in MODELS.items():
        assert info.name == name and info.description and "\n" not in info.description
        assert "last" in info.heads


def test_default_model_per_dataset():
    assert default_model("digits") == "mlp"
    for dataset in ("mnist", "fashion_mnist", "cifar10", "cifar100"):
        assert default_model(dataset) == "cnn"
    with pytest.raises(ValueError, match="known datasets"):
        default_model("imagenet")


def test_unknown_model_name_lists_allowed_names():
    with pytest.raises(ValueError, match="unknown model 'vgg'.*mlp.*cnn_proto"):
        build_model("vgg", CIFAR, 10)


def test_unsupported_head_says_which_heads_are_supported():
    with pytest.raises(ValueError, match="does not support head='body'.*'last', 'fc'"):
        build_model("cnn", MNIST, 10, head="body")


def test_unknown_option_lists_the_models_options():
    with pytest.raises(ValueError, match="no option.*'width'.*c2, kernel"):
        build_model("cnn_proto", MNIST, 10, width=3)
    with pytest.raises(ValueError, match="options are: none"):
        build_model("cnn", MNIST, 10, stem="imagenet")


@pytest.mark.parametrize("call, message", [
    (lambda: build_model("cnn", (784,), 10), r"needs an image input_shape \(C, H, W\)"),
    (lambda: build_model("cnn", (1, 8, 8), 10), "too small"),
    (lambda: build_model("cnn", MNIST, 0), "num_classes must be a positive int"),
    (lambda: build_model("resnet18", CIFAR, 10, conv_stride=1), "ImageNet stem only"),
    (lambda: build_model("resnet18", CIFAR, 10, stem="tiny"), "stem must be one of"),
    (lambda: build_model("cnn_proto", MNIST, 10, c2=0), "c2 must be a positive int"),
])
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_layer_state_dict_rejects_another_architecture():
    with pytest.raises(ValueError, match="does not fit"):
        load_layer_state_dict(build_model("cnn", MNIST, 10),
                              layer_state_dict(build_model("mlp", MNIST, 10)))


def test_model_ops_chunked_forward_equals_one_forward():
    from pfedkit.core.model_ops import ModelOps
    ops = ModelOps(lambda: build_model("mlp", (6,), 3))
    params, x = ops.initial_params(), torch.randn(11, 6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ops.logits(params, x, chunk=4), ops.logits(params, x))
    torch.testing.assert_close(ops.features(params, x, chunk=4), ops.features(params, x))
    assert ops.features(params, x, chunk=4).shape[0] == 11
