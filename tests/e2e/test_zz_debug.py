import time
from tests.helpers import TEST_API_KEY
from tests.e2e.test_fleet_page import *  # noqa
from tests.e2e.test_docs_browser import browser  # noqa


def test_debug(fleet, browser):
    driver = browser
    driver.get(f"{fleet.local.api_url}/#fleet")
    time.sleep(3)
    driver.find_element("id", "key-input").send_keys(TEST_API_KEY)
    driver.execute_script("document.querySelector('#key-form button').click()")
    time.sleep(8)
    print("LOGS", driver.get_log("browser"))
    print("ERR", driver.execute_script("return document.querySelector('#error').outerHTML"))
    print("ROWS", driver.execute_script("return document.querySelector('#machines tbody').innerHTML.slice(0, 3000)"))
    driver.execute_script("location.hash='#submit'")
    time.sleep(3)
    print("LOGS2", driver.get_log("browser"))
    print("FORM", driver.execute_script("return document.querySelector('#submit-form').innerHTML.slice(0, 3000)"))
    assert 0
